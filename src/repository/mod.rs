//! Model repositories: finding models on storage, reading their configs, and the registry of
//! loaded versions.
pub mod pbtxt;
