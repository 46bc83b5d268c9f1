use cuda_pinned::{PinMemory, PinnedVec};

use crate::support::Counting;

#[test]
fn slices_vecs_arrays_options_and_tuples_pin() {
    let allocator = Counting::default();
    let data = vec![1u16, 2, 3];
    // A reference is an allocator: no `&&`, and the buffers borrow it.
    let pinned: PinnedVec<u16, &Counting> = data.pin_memory_in(&allocator).unwrap();
    assert_eq!(pinned, data);
    let (a, b, c) = ([1u8; 4], Some(vec![5i64]), None::<Vec<u8>>)
        .pin_memory_in(&allocator)
        .unwrap();
    assert_eq!(a, [1u8; 4][..]);
    assert_eq!(b.unwrap(), [5i64][..]);
    assert!(c.is_none());
    drop(a);
    assert_eq!(allocator.live(), 1, "only `pinned` is still alive");
    drop(pinned);
    assert_eq!(allocator.live(), 0);
}
