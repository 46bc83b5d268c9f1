//! `PinnedVec` against `Vec`: random operation programs, equal contents after every step,
//! injected allocation failures leave the vector unchanged, nothing leaks.

use std::sync::atomic::Ordering;

use cuda_pinned::{Error, PinnedVec};
use proptest::prelude::*;

use crate::support::Counting;

#[derive(Clone, Debug)]
enum Op {
    Push(u32),
    Pop,
    Extend(Vec<u32>),
    Truncate(usize),
    Resize(usize, u32),
    Reserve(usize),
    Clear,
    Write(Vec<u8>),
    /// The next allocation fails.
    FailNext,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => any::<u32>().prop_map(Op::Push),
        1 => Just(Op::Pop),
        2 => proptest::collection::vec(any::<u32>(), 0..300).prop_map(Op::Extend),
        1 => (0usize..400).prop_map(Op::Truncate),
        1 => (0usize..3000, any::<u32>()).prop_map(|(n, v)| Op::Resize(n, v)),
        1 => (0usize..5000).prop_map(Op::Reserve),
        1 => Just(Op::Clear),
        1 => proptest::collection::vec(any::<u8>(), 0..64).prop_map(Op::Write),
        1 => Just(Op::FailNext),
    ]
}

fn config() -> ProptestConfig {
    crate::support::proptest_config(256, 8)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn behaves_like_vec(
        ops in proptest::collection::vec(op(), 1..60),
        growth_factor in prop_oneof![Just(1usize), Just(4)],
    ) {
        let allocator = Counting::default();
        allocator.growth_factor.store(growth_factor, Ordering::SeqCst);
        {
            let mut pinned = PinnedVec::<u32, _>::new_in(allocator.clone());
            let mut bytes = PinnedVec::<u8, _>::new_in(allocator.clone());
            let (mut model, mut byte_model) = (Vec::<u32>::new(), Vec::<u8>::new());
            for op in ops {
                let before = model.clone();
                let result = match op.clone() {
                    Op::Push(v) => pinned.try_push(v).map(|()| model.push(v)),
                    Op::Pop => { prop_assert_eq!(pinned.pop(), model.pop()); Ok(()) }
                    Op::Extend(values) => pinned.try_extend_from_slice(&values).map(|()| model.extend(&values)),
                    Op::Truncate(n) => { pinned.truncate(n); model.truncate(n); Ok(()) }
                    Op::Resize(n, v) => pinned.try_resize(n, v).map(|()| model.resize(n, v)),
                    Op::Reserve(n) => {
                        let reserved = pinned.try_reserve(n);
                        if reserved.is_ok() {
                            prop_assert!(pinned.capacity() >= pinned.len() + n);
                        }
                        reserved
                    }
                    Op::Clear => { pinned.clear(); model.clear(); Ok(()) }
                    Op::Write(data) => {
                        use std::io::Write;
                        let written = bytes.write_all(&data).is_ok();
                        if written { byte_model.extend(&data); }
                        Ok(())
                    }
                    Op::FailNext => { allocator.fail.store(true, Ordering::SeqCst); Ok(()) }
                };
                match result {
                    Ok(()) => {}
                    Err(Error::OutOfMemory { .. }) => prop_assert_eq!(&model, &before, "failed op changed the model"),
                    Err(e) => return Err(TestCaseError::fail(format!("unexpected error {e}"))),
                }
                if !matches!(op, Op::FailNext) {
                    allocator.fail.store(false, Ordering::SeqCst);
                }
                prop_assert_eq!(pinned.as_slice(), model.as_slice());
                prop_assert_eq!(pinned.len(), model.len());
                prop_assert!(pinned.capacity() >= pinned.len());
                prop_assert_eq!(bytes.as_slice(), byte_model.as_slice());
            }
            let owned: Vec<u32> = pinned.into_iter().collect();
            prop_assert_eq!(owned, model);
        }
        prop_assert_eq!(allocator.live(), 0, "allocations leaked");
    }
}

#[test]
fn new_does_not_allocate_and_growth_is_amortised() {
    let allocator = Counting::default();
    let mut v = PinnedVec::<u64, _>::new_in(allocator.clone());
    assert_eq!(allocator.allocations.load(Ordering::SeqCst), 0);
    for i in 0..100_000 {
        v.push(i);
    }
    // Geometric growth: a handful of allocations for 100k pushes, not one per push.
    assert!(allocator.allocations.load(Ordering::SeqCst) < 20);
    drop(v);
    assert_eq!(allocator.live(), 0);
}

#[test]
fn growth_in_place_keeps_the_address_and_falls_back_to_a_copy() {
    let allocator = Counting::default();
    allocator.growth_factor.store(16, Ordering::SeqCst);
    let mut v = PinnedVec::<u32, _>::with_capacity_in(256, allocator.clone()).unwrap();
    let start = v.as_ptr();
    // 16 × 256 elements of room: pushes up to it grow in place.
    for i in 0..4096 {
        v.push(i);
    }
    assert_eq!(v.as_ptr(), start, "moved while the room lasted");
    assert_eq!(allocator.allocations.load(Ordering::SeqCst), 1);
    assert!(allocator.grown.load(Ordering::SeqCst) >= 4);
    // Past the room the vector moves, contents and all.
    v.push(4096);
    assert_eq!(allocator.allocations.load(Ordering::SeqCst), 2);
    assert!(v.iter().copied().eq(0..4097));
    // A failed growth leaves the vector as it was.
    allocator.fail.store(true, Ordering::SeqCst);
    let capacity = v.capacity();
    assert!(v.try_reserve(capacity).is_err());
    assert_eq!((v.capacity(), v.len()), (capacity, 4097));
    allocator.fail.store(false, Ordering::SeqCst);
    drop(v);
    assert_eq!(allocator.live(), 0);
}

#[test]
fn zero_sized_types_and_empty_vectors_never_allocate() {
    let allocator = Counting::default();
    let mut units = PinnedVec::<(), _>::new_in(allocator.clone());
    for _ in 0..1000 {
        units.push(());
    }
    assert_eq!(units.len(), 1000);
    assert_eq!(units.capacity(), usize::MAX);
    let empty = PinnedVec::<u8, _>::with_capacity_in(0, allocator.clone()).unwrap();
    assert!(empty.memory_kind().is_none());
    drop((units, empty));
    assert_eq!(allocator.allocations.load(Ordering::SeqCst), 0);
}

#[test]
fn capacity_overflow_is_an_error() {
    assert!(matches!(
        PinnedVec::<u64>::with_capacity(usize::MAX),
        Err(Error::CapacityOverflow)
    ));
    assert!(matches!(
        PinnedVec::<u8>::with_capacity(usize::MAX),
        Err(Error::CapacityOverflow)
    ));
    let mut v = PinnedVec::<u16>::from_slice(&[1, 2]).unwrap();
    assert!(matches!(
        v.try_reserve(usize::MAX),
        Err(Error::CapacityOverflow)
    ));
    assert_eq!(v, [1u16, 2][..]);
}

#[test]
fn drops_every_element_once() {
    use std::rc::Rc;
    let counter = Rc::new(());
    let mut v = PinnedVec::new_in(Counting::default());
    for _ in 0..50 {
        v.push(counter.clone());
    }
    v.truncate(10);
    assert_eq!(Rc::strong_count(&counter), 11);
    let mut iter = v.into_iter();
    let _first = iter.next();
    drop(iter);
    assert_eq!(Rc::strong_count(&counter), 2);
}

#[test]
fn clone_eq_debug_bytes_and_raw_parts() {
    let v = PinnedVec::<u16, _>::from_slice_in(&[1, 2, 3], Counting::default()).unwrap();
    let w = v.clone();
    assert_eq!(v, w);
    assert_eq!(format!("{v:?}"), "[1, 2, 3]");
    assert_eq!(v.as_bytes(), &[1, 0, 2, 0, 3, 0]);
    let (allocation, len, allocator) = w.into_raw_parts();
    // SAFETY: the parts come straight from `into_raw_parts`; no device work used them.
    let back = unsafe { PinnedVec::<u16, _>::from_raw_parts(allocation, len, allocator) };
    assert_eq!(back, v);
    let zeros = PinnedVec::<f64>::zeroed(5).unwrap();
    assert_eq!(zeros.as_slice(), &[0.0; 5]);
}
