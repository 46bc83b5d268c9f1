//! Panics from user code (an allocator, an element's destructor) leave every container
//! consistent: never pointing at memory it gave back, and never keeping memory it owns.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::Ordering;

use cuda_pinned::{PinnedBox, PinnedVec};

use crate::support::Counting;

/// Panics when dropped while `armed`.
struct Bomb {
    armed: bool,
}

impl Drop for Bomb {
    fn drop(&mut self) {
        if self.armed {
            panic!("element destructor panicked (on purpose)");
        }
    }
}

#[test]
fn a_vector_whose_allocator_unwinds_while_growing_keeps_live_memory() {
    let allocator = Counting::default();
    let mut v = PinnedVec::<u64, _>::with_capacity_in(4, allocator.clone()).unwrap();
    let capacity = v.capacity();
    v.extend(0..capacity as u64);
    allocator.panic_on_free.store(true, Ordering::SeqCst);
    // Growing gives the old block back, and the allocator unwinds out of that.
    let grown = catch_unwind(AssertUnwindSafe(|| v.push(u64::MAX)));
    allocator.panic_on_free.store(false, Ordering::SeqCst);
    assert!(grown.is_err());
    // The vector is on the new block, with every element moved: reading it reads live memory
    // (under Miri or ASan a read of the freed block is reported).
    assert!(v.capacity() > capacity);
    let expected: Vec<u64> = (0..capacity as u64).collect();
    assert_eq!(&v[..capacity], &expected[..]);
    v.push(7);
    drop(v);
    assert_eq!(allocator.live(), 0);
}

#[test]
fn a_panicking_element_destructor_does_not_leak_the_buffer() {
    let allocator = Counting::default();
    let mut v = PinnedVec::new_in(allocator.clone());
    v.extend((0..5).map(|i| Bomb { armed: i == 2 }));
    assert!(catch_unwind(AssertUnwindSafe(move || drop(v))).is_err());
    assert_eq!(allocator.live(), 0, "the vector's buffer leaked");

    let boxed = PinnedBox::new_in(Bomb { armed: true }, allocator.clone()).unwrap();
    assert!(catch_unwind(AssertUnwindSafe(move || drop(boxed))).is_err());
    assert_eq!(allocator.live(), 0, "the box's buffer leaked");

    let mut v = PinnedVec::new_in(allocator.clone());
    v.extend((0..5).map(|i| Bomb { armed: i == 3 }));
    let mut iter = v.into_iter();
    let first = iter.next().unwrap();
    assert!(catch_unwind(AssertUnwindSafe(move || drop(iter))).is_err());
    drop(first);
    assert_eq!(allocator.live(), 0, "the iterator's buffer leaked");
}

#[test]
fn a_panicking_clone_keeps_the_length_right() {
    #[derive(Debug)]
    struct Fragile(u32);
    impl Clone for Fragile {
        fn clone(&self) -> Self {
            assert_ne!(self.0, 3, "clone panicked (on purpose)");
            Fragile(self.0)
        }
    }
    let allocator = Counting::default();
    let mut v = PinnedVec::new_in(allocator.clone());
    let source: Vec<_> = (0..6).map(Fragile).collect();
    assert!(catch_unwind(AssertUnwindSafe(|| v.extend_from_slice(&source))).is_err());
    // The three clones made before the panic are in, and dropped once with the vector.
    assert_eq!(v.iter().map(|f| f.0).collect::<Vec<_>>(), [0, 1, 2]);
    drop(v);
    assert_eq!(allocator.live(), 0);
}
