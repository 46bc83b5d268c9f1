//! The pool's integration tests, one binary. GPU tests are ignored without a device.

mod support;

mod concurrency;
mod config;
mod faults;
mod model;
mod numa;
mod pressure;
mod reserve;
mod reuse;
mod soundness;
mod waste;
