//! Files read into page-locked memory: the operating system's side, shared by the crates
//! that read datasets and checkpoints.
//!
//! | file | what |
//! |---|---|
//! | `open.rs` | [`open_regular_file`](crate::open_regular_file): a user-named file opened for reading, never blocking on a pipe or opening a device |
//! | `page_cache.rs` | [`PageCacheProbe`](crate::PageCacheProbe): which bytes of a file the page cache holds; advice on what will be read ([`advise_random`](crate::advise_random), [`advise_will_need`](crate::advise_will_need)) |

pub(crate) mod open;
pub(crate) mod page_cache;
