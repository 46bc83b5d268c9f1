//! allocator-api2 containers in pinned memory.

use allocator_api2::vec::Vec as ApiVec;
use cuda_pinned::HostLocked;

#[test]
fn allocator_api2_vec_grows_in_locked_memory() {
    let mut v = ApiVec::new_in(HostLocked);
    for i in 0..10_000u32 {
        v.push(i);
    }
    assert_eq!(v.iter().map(|&x| u64::from(x)).sum::<u64>(), 49_995_000);
    v.truncate(3);
    v.shrink_to_fit();
    assert_eq!(v.as_slice(), &[0, 1, 2]);
}

#[test]
fn zero_sized_requests_do_not_allocate() {
    let v: ApiVec<u8, _> = ApiVec::with_capacity_in(0, HostLocked);
    assert_eq!(v.capacity(), 0);
    let units: ApiVec<(), _> = ApiVec::with_capacity_in(10, HostLocked);
    assert!(units.capacity() >= 10);
}
