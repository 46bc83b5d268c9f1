//! The public face of checkpoint headers: splits and their errors.

use pinned_io::{Error, Split};
use proptest::prelude::*;

#[test]
fn a_split_outside_its_world_is_an_invalid_request() {
    let error = Split::new(0, 0, 0).unwrap_err();
    assert!(matches!(error, Error::Invalid(_)), "{error:?}");
    let error = Split::new(1, 4, 4).unwrap_err();
    assert!(
        matches!(&error, Error::Invalid(m) if m.contains("rank 4")),
        "{error:?}"
    );
}

proptest! {
    #[test]
    fn a_split_keeps_what_it_was_given(dim in 0usize..8, world in 1usize..64, rank in any::<prop::sample::Index>()) {
        let rank = rank.index(world);
        let split = Split::new(dim, rank, world).unwrap();
        prop_assert_eq!((split.dim(), split.rank(), split.world()), (dim, rank, world));
    }
}
