//! Examples, integration tests and benchmarks for `module-runtime`.
