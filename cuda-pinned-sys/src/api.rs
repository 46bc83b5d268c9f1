//! The `cudart_api!` macro: bindgen's function declarations become methods of [`Cudart`]
//! that resolve their symbol on first use and cache it.
//!
//! [`Cudart`]: crate::Cudart

/// Expands the declarations of `bindings.rs` into the `Symbols` table (one lazily filled slot
/// per function) and one accessor method on `Cudart` per function. An accessor returns the
/// function pointer, or [`LoadError::MissingSymbol`](crate::LoadError::MissingSymbol) when the
/// loaded library does not export it: a missing symbol is an error value, never a panic.
macro_rules! cudart_api {
    ($(
        $(#[link_name = $link:literal])?
        pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?;
    )*) => {
        /// One lazily resolved slot per bound function.
        #[allow(non_snake_case, reason = "fields are named after the C functions")]
        pub(crate) struct Symbols {
            $($name: ::std::sync::OnceLock<Option<unsafe extern "C" fn($($ty),*) $(-> $ret)?>>,)*
        }

        impl Symbols {
            pub(crate) const fn new() -> Self {
                Self { $($name: ::std::sync::OnceLock::new(),)* }
            }
        }

        #[allow(non_snake_case, reason = "methods are named after the C functions")]
        impl crate::Cudart {
            $(
                #[doc = concat!("`", stringify!($name), "`, resolved on first use.")]
                ///
                /// # Errors
                ///
                /// [`LoadError::MissingSymbol`](crate::LoadError::MissingSymbol) when the
                /// loaded libcudart does not export the function.
                pub fn $name(
                    &self,
                ) -> Result<unsafe extern "C" fn($($ty),*) $(-> $ret)?, crate::LoadError> {
                    #[allow(unused_variables, reason = "only set for versioned symbols")]
                    let symbol = stringify!($name);
                    $(let symbol = $link;)?
                    let slot = self.symbols.$name.get_or_init(|| {
                        // SAFETY: the type is the function's C prototype as bindgen read it
                        // from the runtime headers, so calling through it is the C call.
                        unsafe { self.resolve(symbol) }
                    });
                    slot.ok_or_else(|| self.missing_symbol(symbol))
                }
            )*
        }
    };
}
