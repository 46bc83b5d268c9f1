//! What a batch is made of: fields (images, labels, masks), each a fixed number of
//! plain-old-data elements per sample, each its own pinned region.

use std::marker::PhantomData;

use bytemuck::Pod;
use cuda_pinned::DeviceSlice;

use crate::error::BoxError;
use crate::field_buffer::FieldBuffer;

/// The fields of a batch and typed views of them.
///
/// Implemented for [`Field`] and for tuples of up to six `Fields` (`(Field<u8>, Field<i64>)`:
/// images and labels); implement it for a struct of your own by forwarding to such a tuple.
///
/// A batch holds one region of memory per field; sample `j` of a batch takes bytes
/// `j * b .. (j + 1) * b` of each region, `b` being the field's [`sample_bytes`](Self::sample_bytes).
pub trait Fields: Clone + Send + Sync + 'static {
    /// One sample's fields, writable: `(&mut [u8], &mut [i64])`.
    type Sample<'a>;
    /// A batch's fields on the host: `(&[u8], &[i64])`.
    type Host<'a>;
    /// A batch's fields on the device: `(DeviceSlice<u8>, DeviceSlice<i64>)`.
    type Device<'a>;
    /// A batch's fields as host buffers that copies take: `(FieldBuffer<u8>, FieldBuffer<i64>)`.
    type Buffers;

    /// Bytes per sample of each field, in order.
    fn sample_bytes(&self) -> Vec<usize>;

    /// Typed views of one sample, from one byte range per field (taken in order).
    fn sample<'a>(&self, regions: &mut dyn Iterator<Item = &'a mut [u8]>) -> Self::Sample<'a>;

    /// The byte ranges behind a sample's views, one per field, in order (the inverse of
    /// [`sample`](Self::sample)).
    fn sample_as_bytes<'a>(&self, sample: Self::Sample<'a>, out: &mut Vec<&'a mut [u8]>);

    /// Typed views of a batch on the host, from one byte range per field.
    fn host<'a>(&self, regions: &mut dyn Iterator<Item = &'a [u8]>) -> Self::Host<'a>;

    /// Typed views of a batch on the device, from one byte range per field.
    fn device<'a>(
        &self,
        regions: &mut dyn Iterator<Item = DeviceSlice<'a, u8>>,
    ) -> Self::Device<'a>;

    /// Typed host buffers of a batch, from one buffer of bytes per field.
    fn buffers(&self, regions: &mut dyn Iterator<Item = FieldBuffer<u8>>) -> Self::Buffers;
}

/// A field of `per_sample` elements of `T` per sample: an image of `3 * 224 * 224` bytes is
/// `Field::<u8>::new(3 * 224 * 224)`, a label `Field::<i64>::new(1)`.
#[derive(Debug)]
pub struct Field<T> {
    per_sample: usize,
    _element: PhantomData<fn() -> T>,
}

impl<T> Clone for Field<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Field<T> {}

impl<T: Pod> Field<T> {
    /// `per_sample` elements per sample.
    pub const fn new(per_sample: usize) -> Self {
        Self {
            per_sample,
            _element: PhantomData,
        }
    }

    /// Elements per sample.
    pub fn per_sample(&self) -> usize {
        self.per_sample
    }
}

const MISSING: &str = "one region per field";

impl<T: Pod + Send + Sync> Fields for Field<T> {
    type Sample<'a> = &'a mut [T];
    type Host<'a> = &'a [T];
    type Device<'a> = DeviceSlice<'a, T>;
    type Buffers = FieldBuffer<T>;

    fn sample_bytes(&self) -> Vec<usize> {
        // Saturated: a sample this large fails the loader's size checks.
        vec![self.per_sample.saturating_mul(size_of::<T>())]
    }

    fn sample<'a>(&self, regions: &mut dyn Iterator<Item = &'a mut [u8]>) -> &'a mut [T] {
        // Regions start page-aligned and advance by whole samples of `T`, so they are aligned.
        bytemuck::cast_slice_mut(regions.next().expect(MISSING))
    }

    fn sample_as_bytes<'a>(&self, sample: &'a mut [T], out: &mut Vec<&'a mut [u8]>) {
        out.push(bytemuck::cast_slice_mut(sample));
    }

    fn host<'a>(&self, regions: &mut dyn Iterator<Item = &'a [u8]>) -> &'a [T] {
        bytemuck::cast_slice(regions.next().expect(MISSING))
    }

    fn device<'a>(
        &self,
        regions: &mut dyn Iterator<Item = DeviceSlice<'a, u8>>,
    ) -> DeviceSlice<'a, T> {
        let region = regions.next().expect(MISSING);
        region
            .cast()
            .expect("device regions hold whole, aligned elements")
    }

    fn buffers(&self, regions: &mut dyn Iterator<Item = FieldBuffer<u8>>) -> FieldBuffer<T> {
        regions.next().expect(MISSING).cast()
    }
}

macro_rules! tuple_fields {
    ($(($name:ident, $view:ident)),+) => {
        impl<$($name: Fields),+> Fields for ($($name,)+) {
            type Sample<'a> = ($($name::Sample<'a>,)+);
            type Host<'a> = ($($name::Host<'a>,)+);
            type Device<'a> = ($($name::Device<'a>,)+);
            type Buffers = ($($name::Buffers,)+);

            #[allow(non_snake_case, reason = "bindings named after the type parameters")]
            fn sample_bytes(&self) -> Vec<usize> {
                let ($($name,)+) = self;
                let mut bytes = Vec::new();
                $(bytes.extend($name.sample_bytes());)+
                bytes
            }

            #[allow(non_snake_case, reason = "bindings named after the type parameters")]
            fn sample<'a>(&self, regions: &mut dyn Iterator<Item = &'a mut [u8]>) -> Self::Sample<'a> {
                let ($($name,)+) = self;
                ($($name.sample(regions),)+)
            }

            #[allow(non_snake_case, reason = "bindings named after the type parameters")]
            fn sample_as_bytes<'a>(&self, sample: Self::Sample<'a>, out: &mut Vec<&'a mut [u8]>) {
                let ($($name,)+) = self;
                let ($($view,)+) = sample;
                $($name.sample_as_bytes($view, out);)+
            }

            #[allow(non_snake_case, reason = "bindings named after the type parameters")]
            fn host<'a>(&self, regions: &mut dyn Iterator<Item = &'a [u8]>) -> Self::Host<'a> {
                let ($($name,)+) = self;
                ($($name.host(regions),)+)
            }

            #[allow(non_snake_case, reason = "bindings named after the type parameters")]
            fn device<'a>(
                &self,
                regions: &mut dyn Iterator<Item = DeviceSlice<'a, u8>>,
            ) -> Self::Device<'a> {
                let ($($name,)+) = self;
                ($($name.device(regions),)+)
            }

            #[allow(non_snake_case, reason = "bindings named after the type parameters")]
            fn buffers(&self, regions: &mut dyn Iterator<Item = FieldBuffer<u8>>) -> Self::Buffers {
                let ($($name,)+) = self;
                ($($name.buffers(regions),)+)
            }
        }
    };
}

tuple_fields!((A, a));
tuple_fields!((A, a), (B, b));
tuple_fields!((A, a), (B, b), (C, c));
tuple_fields!((A, a), (B, b), (C, c), (D, d));
tuple_fields!((A, a), (B, b), (C, c), (D, d), (E, e));
tuple_fields!((A, a), (B, b), (C, c), (D, d), (E, e), (F, f));

/// Writing a sample value `S` into a sample's fields: the collate step of a
/// [`SampleDataset`](crate::SampleDataset).
///
/// Implemented for a [`Field<T>`] from `T` (one element), `[T; N]`, `&[T]` and `Vec<T>`, and for
/// tuples of fields from tuples of values.
pub trait Collate<S>: Fields {
    /// Writes `sample` into `into`.
    ///
    /// # Errors
    ///
    /// A sample whose shape does not match the field's (a slice of the wrong length).
    fn collate(&self, sample: S, into: Self::Sample<'_>) -> Result<(), BoxError>;
}

/// Copies a sample into its place in a batch, with non-temporal stores: the batch is read
/// next by the DMA engine, not the CPU.
fn copy_exact<T: Pod>(from: &[T], into: &mut [T]) -> Result<(), BoxError> {
    if from.len() != into.len() {
        return Err(format!(
            "a sample field of {} elements, where the field takes {}",
            from.len(),
            into.len()
        )
        .into());
    }
    cuda_pinned::copy_streaming(into, from);
    Ok(())
}

impl<T: Pod + Send + Sync> Collate<T> for Field<T> {
    fn collate(&self, sample: T, into: &mut [T]) -> Result<(), BoxError> {
        copy_exact(&[sample], into)
    }
}

impl<T: Pod + Send + Sync, const N: usize> Collate<[T; N]> for Field<T> {
    fn collate(&self, sample: [T; N], into: &mut [T]) -> Result<(), BoxError> {
        copy_exact(&sample, into)
    }
}

impl<T: Pod + Send + Sync> Collate<&[T]> for Field<T> {
    fn collate(&self, sample: &[T], into: &mut [T]) -> Result<(), BoxError> {
        copy_exact(sample, into)
    }
}

impl<T: Pod + Send + Sync> Collate<Vec<T>> for Field<T> {
    fn collate(&self, sample: Vec<T>, into: &mut [T]) -> Result<(), BoxError> {
        copy_exact(&sample, into)
    }
}

// Written out: each element of the sample goes into the element of the fields at its place.
impl<A: Collate<SA>, B: Collate<SB>, SA, SB> Collate<(SA, SB)> for (A, B) {
    fn collate(&self, (a, b): (SA, SB), (ia, ib): Self::Sample<'_>) -> Result<(), BoxError> {
        self.0.collate(a, ia)?;
        self.1.collate(b, ib)
    }
}

impl<A: Collate<SA>, SA> Collate<(SA,)> for (A,) {
    fn collate(&self, (a,): (SA,), (ia,): Self::Sample<'_>) -> Result<(), BoxError> {
        self.0.collate(a, ia)
    }
}

impl<A: Collate<SA>, B: Collate<SB>, C: Collate<SC>, SA, SB, SC> Collate<(SA, SB, SC)>
    for (A, B, C)
{
    fn collate(
        &self,
        (a, b, c): (SA, SB, SC),
        (ia, ib, ic): Self::Sample<'_>,
    ) -> Result<(), BoxError> {
        self.0.collate(a, ia)?;
        self.1.collate(b, ib)?;
        self.2.collate(c, ic)
    }
}

impl<A, B, C, D, SA, SB, SC, SD> Collate<(SA, SB, SC, SD)> for (A, B, C, D)
where
    A: Collate<SA>,
    B: Collate<SB>,
    C: Collate<SC>,
    D: Collate<SD>,
{
    fn collate(
        &self,
        (a, b, c, d): (SA, SB, SC, SD),
        (ia, ib, ic, id): Self::Sample<'_>,
    ) -> Result<(), BoxError> {
        self.0.collate(a, ia)?;
        self.1.collate(b, ib)?;
        self.2.collate(c, ic)?;
        self.3.collate(d, id)
    }
}
