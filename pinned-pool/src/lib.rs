//! A caching allocator of page-locked host memory (in progress).
