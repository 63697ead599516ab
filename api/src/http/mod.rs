//! The HTTP face of the API: axum extractors and one file per resource. Each handler parses the
//! request into typed input, calls a use case, and renders the answer.

pub mod exec;
pub mod exec_stream;
pub mod files;
