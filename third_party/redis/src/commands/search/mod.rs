//! Types to use with the Redis Search commands.
//!
//! Redis Search provides secondary indexing, full-text search and vector similarity search.
//!
//! Documentation: <https://redis.io/docs/latest/develop/ai/search-and-query/>

pub mod create;

pub use create::*;
