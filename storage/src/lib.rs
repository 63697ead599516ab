//! Berth's object storage and snapshot artifacts.
//!
//! - [`store`]: the object store (`object_store` crate): local filesystem under the state dir
//!   by default, any S3 API store by `BERTH_OBJECT_STORE=s3://bucket/prefix`; the key layout.
//! - [`manifest`]: the artifact format (a JSON manifest plus content-addressed zstd chunks),
//!   documented in ARCHITECTURE.md ("Snapshot artifacts").
//! - [`capture`]: trees to a staged snapshot, incremental against a parent (the frozen part).
//! - [`upload`]: a staged snapshot made durable, manifest last.
//! - [`restore`]: a stored snapshot read back into a directory. (Deleting one is the
//!   control plane's: its chunks go only through the claimed removals of `berth_store::chunks`.)
//! - [`cache`]: the host's bounded LRU cache of chunks.
//!
//! Guarantees: a snapshot's manifest is stored only after every chunk it names, so "the
//! manifest exists" is "the snapshot is durable" (DESIGN.md guarantee 9); every chunk read is
//! checked against its SHA-256. Errors: one [`StorageError`].

pub mod cache;
pub mod capture;
pub mod chunk;
pub mod error;
pub mod manifest;
pub mod restore;
pub mod store;
pub mod upload;

pub use cache::ChunkCache;
pub use capture::{stage, Staged, TreeSource};
pub use error::{StorageError, StoreOp};
pub use manifest::{Holds, Manifest, SnapshotInfo, TreeKind};
pub use restore::{fetch_manifest, is_durable, materialize, missing_chunks};
pub use store::{Listed, Location, Objects, RetrySettings, StoreSettings};
pub use upload::{upload, UploadProgress, UploadReport};
