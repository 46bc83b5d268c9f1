//! GPU tests: written in the next step.
