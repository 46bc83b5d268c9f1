use std::sync::atomic::Ordering;

use cuda_pinned::{MemoryKind, PinnedBox};

use crate::support::Counting;

#[test]
fn boxes_hold_values_and_free_them() {
    let allocator = Counting::default();
    let mut b = PinnedBox::new_in([1u64, 2, 3], allocator.clone()).unwrap();
    b[1] = 20;
    assert_eq!(*b, [1, 20, 3]);
    assert_eq!(b.memory_kind(), Some(MemoryKind::HostLocked));
    assert_eq!(format!("{b:?}"), "[1, 20, 3]");
    assert_eq!(b.into_inner(), [1, 20, 3]);
    assert_eq!(allocator.live(), 0);
}

#[test]
fn zeroed_uninit_and_zero_sized() {
    let allocator = Counting::default();
    let z = PinnedBox::<[u32; 16], _>::new_zeroed_in(allocator.clone()).unwrap();
    assert_eq!(*z, [0; 16]);
    let mut u =
        PinnedBox::<std::mem::MaybeUninit<u32>, _>::new_uninit_in(allocator.clone()).unwrap();
    u.write(7);
    // SAFETY: written just above.
    let u = unsafe { u.assume_init() };
    assert_eq!(*u, 7);
    let unit = PinnedBox::new_in((), allocator.clone()).unwrap();
    assert!(unit.memory_kind().is_none());
    drop((z, u, unit));
    assert_eq!(allocator.live(), 0);
    assert_eq!(
        allocator.allocations.load(Ordering::SeqCst),
        2,
        "the zero-sized box allocated"
    );
}

#[test]
fn drop_runs_the_value_destructor_once() {
    let counter = std::rc::Rc::new(());
    let b = PinnedBox::new_in(counter.clone(), Counting::default()).unwrap();
    assert_eq!(std::rc::Rc::strong_count(&counter), 2);
    drop(b);
    assert_eq!(std::rc::Rc::strong_count(&counter), 1);
}
