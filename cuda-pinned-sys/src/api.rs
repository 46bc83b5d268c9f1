//! The `cudart_api!` and `driver_api!` macros: bindgen's function declarations become methods
//! of [`Cudart`] and [`Driver`] that resolve their symbol on first use and cache it.
//!
//! [`Cudart`]: crate::Cudart
//! [`Driver`]: crate::driver::Driver

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

/// Expands the declarations of `driver_bindings.rs` into the `DriverSymbols` table and one
/// accessor method on [`Driver`] per function, as `cudart_api!` does for the runtime.
macro_rules! driver_api {
    ($(
        pub fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?;
    )*) => {
        /// One lazily resolved slot per bound driver function.
        #[allow(non_snake_case, reason = "fields are named after the C functions")]
        pub(crate) struct DriverSymbols {
            $($name: ::std::sync::OnceLock<
                Result<unsafe extern "C" fn($($ty),*) $(-> $ret)?, crate::LoadError>
            >,)*
        }

        impl DriverSymbols {
            pub(crate) const fn new() -> Self {
                Self { $($name: ::std::sync::OnceLock::new(),)* }
            }
        }

        #[allow(non_snake_case, reason = "methods are named after the C functions")]
        impl crate::driver::Driver {
            $(
                #[doc = concat!("`", stringify!($name), "`, resolved on first use.")]
                ///
                /// # Errors
                ///
                /// [`LoadError::MissingDriverEntryPoint`](crate::LoadError::MissingDriverEntryPoint)
                /// when the runtime or the driver does not provide the function.
                pub fn $name(
                    &self,
                ) -> Result<unsafe extern "C" fn($($ty),*) $(-> $ret)?, crate::LoadError> {
                    let name = concat!(stringify!($name), "\0");
                    self.symbols
                        .$name
                        .get_or_init(|| {
                            let address = self.entry_point(name)?;
                            // SAFETY: the driver returned the function named `name` as of
                            // the bindings' ABI version, whose prototype bindgen read from
                            // cuda.h: a non-null code address of exactly this type.
                            Ok(unsafe {
                                ::std::mem::transmute::<
                                    *mut ::std::ffi::c_void,
                                    unsafe extern "C" fn($($ty),*) $(-> $ret)?,
                                >(address)
                            })
                        })
                        .clone()
                }
            )*

            /// The names of the bound functions that this runtime and driver do not provide,
            /// each resolved now. Where an event, copy or pointer-lookup function is missing,
            /// `cuda-pinned` makes the runtime's call instead; this tells which path it takes.
            /// The virtual-memory functions have no such stand-in.
            pub fn unresolved(&self) -> Vec<&'static str> {
                let mut missing = Vec::new();
                $(
                    if self.$name().is_err() {
                        missing.push(stringify!($name));
                    }
                )*
                missing
            }
        }
    };
}
