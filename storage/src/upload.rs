//! Making a staged snapshot durable: upload each new chunk (skipping one the store already
//! holds at its compressed size), then the manifest, last. Until the manifest is stored the snapshot does not exist
//! for anyone reading the store; a failure at any point leaves no manifest behind, so nothing
//! is ever reported ready that is not durable (DESIGN.md guarantee 9). Chunks uploaded before
//! a failure stay: they are content-addressed, so a retry skips them, and a sweep of chunks no
//! manifest references removes them otherwise.

use futures::StreamExt;

use crate::cache::ChunkCache;
use crate::capture::Staged;
use crate::error::{Result, StorageError};
use crate::store::Objects;

/// Chunks in flight at once.
pub const UPLOAD_CONCURRENCY: usize = 4;

/// What an upload did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UploadReport {
    /// Chunks sent.
    pub chunks_uploaded: u64,
    /// Compressed bytes sent (chunks only).
    pub bytes_uploaded: u64,
    /// New chunks the store already held whole (another sandbox's snapshot had them).
    pub chunks_already_stored: u64,
    /// Bytes of the manifest.
    pub manifest_bytes: u64,
}

/// Progress after each chunk, for logs and for tests that act mid-upload.
#[derive(Debug, Clone, Copy)]
pub struct UploadProgress {
    /// Chunks done so far (sent or found stored).
    pub chunks_done: u64,
    /// Chunks to do in all.
    pub chunks_total: u64,
}

/// Uploads `staged`, then moves its chunks into `cache` (when given), which keeps the host's
/// copy for a later restore or clone on this host. `observe` is called after each chunk.
///
/// Errors: [`StorageError::Store`] (the store refused, is down, or timed out after its
/// retries), [`StorageError::Io`] reading a staged chunk. On error no manifest was written.
pub async fn upload(
    objects: &Objects,
    staged: Staged,
    cache: Option<&ChunkCache>,
    observe: &(dyn Fn(UploadProgress) + Send + Sync),
) -> Result<UploadReport> {
    let total = staged.new_chunks.len() as u64;
    // Owned jobs: the futures borrow nothing, so the upload can run inside a spawned task.
    let jobs: Vec<(object_store::path::Path, std::path::PathBuf, u64)> = staged
        .new_chunks
        .iter()
        .map(|(hash, stored)| (Objects::chunk_key(hash), staged.chunk_path(hash), *stored))
        .collect();
    let mut pending = futures::stream::iter(jobs.into_iter().map(|(key, path, stored)| {
        let objects = objects.clone();
        async move {
            // Skipped only when held whole: an object of another size (truncated, replaced)
            // is written again, so a check of the stored copy (`missing_chunks`) can pass.
            if objects.size(&key).await? == Some(stored) {
                return Ok::<_, StorageError>(None);
            }
            let body = tokio::fs::read(&path)
                .await
                .map_err(StorageError::io("read", &path))?;
            let len = body.len() as u64;
            objects.put(&key, body.into()).await?;
            Ok(Some(len))
        }
    }))
    .buffer_unordered(UPLOAD_CONCURRENCY);
    let mut outcomes = Vec::new();
    while let Some(sent) = pending.next().await {
        outcomes.push(sent?);
        observe(UploadProgress {
            chunks_done: outcomes.len() as u64,
            chunks_total: total,
        });
    }
    drop(pending);
    let body = staged.manifest.to_json();
    let manifest_bytes = body.len() as u64;
    objects
        .put(
            &Objects::manifest_key(staged.manifest.info.snapshot_id),
            body.into(),
        )
        .await?;
    if let Some(cache) = cache {
        for (hash, _) in &staged.new_chunks {
            // The cache is an optimisation: a chunk that cannot be kept is fetched again later.
            if let Err(e) = cache.insert_file(hash, &staged.chunk_path(hash)) {
                tracing::warn!(error = %e, "a durable chunk could not be kept in the host cache");
            }
        }
    }
    let mut report = UploadReport {
        manifest_bytes,
        ..UploadReport::default()
    };
    for o in outcomes {
        match o {
            Some(len) => {
                report.chunks_uploaded += 1;
                report.bytes_uploaded += len;
            }
            None => report.chunks_already_stored += 1,
        }
    }
    Ok(report)
}
