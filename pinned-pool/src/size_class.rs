//! Size classes: page-granular up to 32 KiB, then eight classes per power of two, so no
//! request of 4 KiB or more is rounded up by more than 12.5% plus one page (PyTorch rounds to
//! the next power of two: up to 100%).

/// The page all classes are multiples of.
pub(crate) const PAGE: usize = 4096;
/// Classes per power of two above 32 KiB.
const STEPS: usize = 8;
/// Up to here classes are page multiples: 4, 8, …, 32 KiB.
const LINEAR_END: usize = STEPS * PAGE;
/// The largest class: 2^47 bytes (128 TiB).
pub(crate) const MAX_CLASS_BYTES: usize = 1 << 47;
/// Number of classes.
pub(crate) const CLASSES: usize = STEPS + STEPS * (47 - 15);

/// A slot is a class on one NUMA node: `node × SLOT_STRIDE + class`. The stride is a power of
/// two, so a slot's class is one mask away; lists indexed by slot hold [`slots`] entries.
pub(crate) const SLOT_STRIDE: usize = 512;
const _: () = assert!(CLASSES <= SLOT_STRIDE && SLOT_STRIDE.is_power_of_two());
/// Nodes kept apart at most; nodes past it share slots (node numbers modulo this).
pub(crate) const MAX_NODES: usize = 16;

/// The slots for `nodes` nodes (1 to [`MAX_NODES`]): exactly the classes for one.
pub(crate) const fn slots(nodes: usize) -> usize {
    (nodes - 1) * SLOT_STRIDE + CLASSES
}

/// The class of a request of `bytes` (> 0): `(index, class size)`; `None` above the largest.
#[inline]
pub(crate) fn class_of(bytes: usize) -> Option<(usize, usize)> {
    if bytes > MAX_CLASS_BYTES {
        return None;
    }
    if bytes <= LINEAR_END {
        let pages = bytes.div_ceil(PAGE).max(1);
        return Some((pages - 1, pages * PAGE));
    }
    // 2^k < bytes ≤ 2^(k+1), k ≥ 15; steps of 2^(k-3). Shifts, not divisions: this runs on
    // every allocation.
    let k = usize::BITS as usize - 1 - (bytes - 1).leading_zeros() as usize;
    let shift = k - 3;
    let steps = ((bytes - 1) >> shift) + 1; // 9..=16 steps of 2^shift
    Some((STEPS + (k - 15) * STEPS + steps - 9, steps << shift))
}

/// The size of class `index` (or of the class of slot `index`).
#[inline]
pub(crate) fn class_size(index: usize) -> usize {
    let index = index & (SLOT_STRIDE - 1);
    if index < STEPS {
        return (index + 1) * PAGE;
    }
    let k = 15 + (index - STEPS) / STEPS;
    let j = (index - STEPS) % STEPS + 1;
    (1 << k) + j * (1 << (k - 3))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes_bound_the_waste() {
        let mut bytes = 1usize;
        while bytes < (1 << 40) {
            for probe in [bytes, bytes + 1, bytes * 3 / 2, bytes * 2 - 1] {
                let (index, size) = class_of(probe).unwrap();
                assert!(size >= probe, "{probe} -> {size}");
                assert_eq!(size % PAGE, 0);
                assert_eq!(class_size(index), size, "index {index} of {probe}");
                if probe >= PAGE {
                    assert!(
                        size - probe <= probe / 8 + PAGE,
                        "{probe} rounded to {size}"
                    );
                }
            }
            bytes *= 2;
        }
    }

    #[test]
    fn indices_are_dense_and_increasing() {
        let mut last = 0;
        for index in 0..CLASSES {
            let size = class_size(index);
            assert!(size > last);
            assert_eq!(class_of(size), Some((index, size)));
            last = size;
        }
        assert_eq!(last, MAX_CLASS_BYTES);
        assert_eq!(class_of(MAX_CLASS_BYTES + 1), None);
    }
}
