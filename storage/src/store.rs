//! Where artifacts live: the object store named by `BERTH_OBJECT_STORE`, opened through the
//! `object_store` crate, and the key layout inside it.
//!
//! - Default: a local-filesystem store under the state dir (`<state dir>/objects`), so
//!   `berth dev` and `deploy/up` need nothing installed. Writes go to a temporary file and are
//!   renamed into place, so a reader never sees half an object.
//! - `s3://bucket/prefix`: any S3 API store. Endpoint, region and credentials come from the
//!   usual `AWS_*` variables (`AWS_ENDPOINT`, `AWS_REGION`, `AWS_ACCESS_KEY_ID`,
//!   `AWS_SECRET_ACCESS_KEY`, `AWS_ALLOW_HTTP`, ...; see `object_store::aws::AmazonS3ConfigKey`),
//!   overridable by [`StoreSettings::s3_options`]. A single PUT either lands whole or not at all.
//!
//! Keys (below the prefix): `chunks/<first two hex digits>/<sha256>.zst` for content and
//! `manifests/<snapshot id>.json` for manifests. The manifest is written last, so "a manifest
//! exists" is the durability test (DESIGN.md guarantee 9).
//!
//! Errors: every call returns [`StorageError::Store`] naming the operation and key once the
//! store's own retries ([`RetrySettings`]) are spent.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use berth_schemas::ids::SnapshotId;
use bytes::Bytes;
use futures::TryStreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path as Key;
use object_store::prefix::PrefixStore;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, PutPayload, RetryConfig};

use crate::error::{Result, StorageError, StoreOp};

/// The environment variable that names the object store (`s3://bucket/prefix`,
/// `file:///abs/dir` or an absolute directory). Unset: [`Location::default_under`].
pub const OBJECT_STORE_ENV: &str = "BERTH_OBJECT_STORE";
/// The directory below the state dir that the default local store uses.
pub const DEFAULT_LOCAL_DIR: &str = "objects";
/// Retries of one request after the first attempt (connection errors, 5xx, timeouts).
pub const DEFAULT_MAX_RETRIES: usize = 5;
/// No request is retried once this long has passed since its first attempt.
pub const DEFAULT_RETRY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one HTTP request may take, body included (a 4 MiB chunk on a slow link fits).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// How long connecting to the S3 endpoint may take.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where the object store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A directory on this machine (created when missing).
    Local(PathBuf),
    /// An S3 bucket, with an optional key prefix (no leading or trailing `/`).
    S3 {
        /// The bucket name.
        bucket: String,
        /// The key prefix inside the bucket; empty for none.
        prefix: String,
    },
}

impl Location {
    /// The default: a local store at `<state_dir>/objects`.
    pub fn default_under(state_dir: &Path) -> Location {
        Location::Local(state_dir.join(DEFAULT_LOCAL_DIR))
    }

    /// Parses `s3://bucket[/prefix]`, `file:///abs/dir` or `/abs/dir`.
    ///
    /// Errors: [`StorageError::Config`] for another scheme, an empty bucket, a relative path, or
    /// a prefix with an empty or `..` segment.
    pub fn parse(value: &str) -> Result<Location> {
        let bad = |reason: &str| StorageError::Config {
            value: value.to_owned(),
            reason: reason.to_owned(),
        };
        if let Some(rest) = value.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            let prefix = prefix.trim_end_matches('/');
            if bucket.is_empty() {
                return Err(bad("the bucket is empty"));
            }
            if !prefix.is_empty()
                && prefix
                    .split('/')
                    .any(|s| s.is_empty() || s == "." || s == "..")
            {
                return Err(bad("the prefix has an empty, `.` or `..` segment"));
            }
            return Ok(Location::S3 {
                bucket: bucket.to_owned(),
                prefix: prefix.to_owned(),
            });
        }
        let path = value.strip_prefix("file://").unwrap_or(value);
        if !path.starts_with('/') {
            return Err(bad(
                "expected s3://bucket/prefix, file:///absolute/dir or an absolute dir",
            ));
        }
        Ok(Location::Local(PathBuf::from(path)))
    }

    /// `BERTH_OBJECT_STORE` when set and not empty, else [`Location::default_under`].
    pub fn from_env_or_default(state_dir: &Path) -> Result<Location> {
        match std::env::var(OBJECT_STORE_ENV) {
            Ok(v) if !v.is_empty() => Location::parse(&v),
            _ => Ok(Location::default_under(state_dir)),
        }
    }
}

/// How hard the S3 client tries before a request fails.
#[derive(Debug, Clone, Copy)]
pub struct RetrySettings {
    /// Retries after the first attempt.
    pub max_retries: usize,
    /// Give up retrying once this long has passed since the first attempt.
    pub retry_timeout: Duration,
    /// One request's whole duration.
    pub request_timeout: Duration,
    /// Connecting.
    pub connect_timeout: Duration,
}

impl Default for RetrySettings {
    fn default() -> Self {
        RetrySettings {
            max_retries: DEFAULT_MAX_RETRIES,
            retry_timeout: DEFAULT_RETRY_TIMEOUT,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
        }
    }
}

/// Everything needed to open the object store.
#[derive(Debug, Clone)]
pub struct StoreSettings {
    /// Where it is.
    pub location: Location,
    /// S3 options applied over the `AWS_*` environment, as `object_store` names them
    /// (`aws_endpoint`, `aws_access_key_id`, `aws_secret_access_key`, `aws_region`,
    /// `aws_allow_http`, ...). Ignored for a local store.
    pub s3_options: Vec<(String, String)>,
    /// Retries and timeouts of the S3 client.
    pub retry: RetrySettings,
}

impl StoreSettings {
    /// Settings for `location` with the environment's S3 options and default retries.
    pub fn new(location: Location) -> StoreSettings {
        StoreSettings {
            location,
            s3_options: Vec::new(),
            retry: RetrySettings::default(),
        }
    }
}

/// One object a listing found ([`Objects::list_manifests`], [`Objects::list_chunks`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed<N> {
    /// What its key names: a snapshot id (a manifest) or a sha256 in hex (a chunk).
    pub name: N,
    /// Its size in bytes (a chunk's: compressed).
    pub size: u64,
    /// When it was last written, on the store's clock: an S3 server's `Last-Modified`, a local
    /// store's file mtime (whole seconds on S3). A content-addressed chunk that an upload
    /// skipped because the store held it keeps its old time: this says nothing about who still
    /// counts on it.
    pub last_modified: SystemTime,
}

/// An opened object store plus Berth's key layout. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Objects {
    inner: Arc<dyn ObjectStore>,
}

impl Objects {
    /// Opens (and for a local store, creates) the store.
    ///
    /// Errors: [`StorageError::Config`] for an unknown S3 option or a builder refusal,
    /// [`StorageError::Io`] when the local directory cannot be created. Nothing is contacted
    /// yet: a down S3 server shows up on the first request.
    pub fn open(settings: &StoreSettings) -> Result<Objects> {
        let inner: Arc<dyn ObjectStore> = match &settings.location {
            Location::Local(dir) => {
                std::fs::create_dir_all(dir).map_err(StorageError::io("create", dir))?;
                let fs =
                    LocalFileSystem::new_with_prefix(dir).map_err(|e| StorageError::Config {
                        value: dir.display().to_string(),
                        reason: e.to_string(),
                    })?;
                Arc::new(fs)
            }
            Location::S3 { bucket, prefix } => {
                let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
                for (k, v) in &settings.s3_options {
                    let key: AmazonS3ConfigKey =
                        k.parse()
                            .map_err(|e: object_store::Error| StorageError::Config {
                                value: k.clone(),
                                reason: e.to_string(),
                            })?;
                    builder = builder.with_config(key, v);
                }
                let r = settings.retry;
                let s3 = builder
                    .with_retry(RetryConfig {
                        backoff: BackoffConfig::default(),
                        max_retries: r.max_retries,
                        retry_timeout: r.retry_timeout,
                    })
                    .with_client_options(
                        ClientOptions::new()
                            .with_timeout(r.request_timeout)
                            .with_connect_timeout(r.connect_timeout)
                            .with_allow_http(
                                settings.s3_options.iter().any(|(k, v)| {
                                    (k == "aws_allow_http" || k == "allow_http") && v == "true"
                                }) || std::env::var("AWS_ALLOW_HTTP").is_ok_and(|v| v == "true"),
                            ),
                    )
                    .build()
                    .map_err(|e| StorageError::Config {
                        value: format!("s3://{bucket}/{prefix}"),
                        reason: e.to_string(),
                    })?;
                if prefix.is_empty() {
                    Arc::new(s3)
                } else {
                    Arc::new(PrefixStore::new(s3, prefix.as_str()))
                }
            }
        };
        Ok(Objects { inner })
    }

    /// The key of a chunk: `chunks/<hh>/<sha256>.zst`.
    pub fn chunk_key(hash: &str) -> Key {
        Key::from(format!("chunks/{}/{hash}.zst", &hash[..2.min(hash.len())]))
    }

    /// The key of a snapshot's manifest: `manifests/<id>.json`.
    pub fn manifest_key(id: SnapshotId) -> Key {
        Key::from(format!("manifests/{id}.json"))
    }

    /// Writes one object whole (replacing any object at `key`).
    pub async fn put(&self, key: &Key, body: Bytes) -> Result<()> {
        self.inner
            .put(key, PutPayload::from_bytes(body))
            .await
            .map_err(StorageError::store(StoreOp::Put, key))?;
        Ok(())
    }

    /// Reads one object; `None` when it does not exist.
    pub async fn get(&self, key: &Key) -> Result<Option<Bytes>> {
        match self.inner.get(key).await {
            Ok(r) => Ok(Some(
                r.bytes()
                    .await
                    .map_err(StorageError::store(StoreOp::Get, key))?,
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(StorageError::store(StoreOp::Get, key)(e)),
        }
    }

    /// Whether an object exists.
    pub async fn exists(&self, key: &Key) -> Result<bool> {
        Ok(self.size(key).await?.is_some())
    }

    /// An object's size in bytes as the store reports it (one `HEAD`); `None` when it does
    /// not exist.
    pub async fn size(&self, key: &Key) -> Result<Option<u64>> {
        match self.inner.head(key).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(StorageError::store(StoreOp::Head, key)(e)),
        }
    }

    /// Removes an object; a missing one is not an error (deletes are retried after crashes).
    pub async fn delete(&self, key: &Key) -> Result<()> {
        match self.inner.delete(key).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(StorageError::store(StoreOp::Delete, key)(e)),
        }
    }

    /// The chunk hash a key names (`chunks/<hh>/<sha256>.zst`, `<hh>` its first two hex
    /// digits), or `None` for any other key.
    pub fn chunk_of_key(key: &str) -> Option<String> {
        let rest = key.strip_prefix("chunks/")?;
        let (dir, file) = rest.split_once('/')?;
        let hash = file.strip_suffix(".zst")?;
        let hex = hash.len() == 64 && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        (hex && dir == &hash[..2]).then(|| hash.to_owned())
    }

    /// The snapshot a key names (`manifests/<snapshot id>.json`), or `None` for any other key.
    pub fn manifest_of_key(key: &str) -> Option<SnapshotId> {
        key.strip_prefix("manifests/")?
            .strip_suffix(".json")?
            .parse()
            .ok()
    }

    /// Every stored manifest with its size and last-modified time (see [`Listed`]); keys below
    /// `manifests/` of another form are left out (nothing reads or removes them).
    ///
    /// Errors: [`StorageError::Store`] (op `list`).
    pub async fn list_manifests(&self) -> Result<Vec<Listed<SnapshotId>>> {
        self.list_named("manifests", Objects::manifest_of_key).await
    }

    /// Every stored chunk with its size and last-modified time (see [`Listed`]); keys below
    /// `chunks/` of another form (a local store's half-written temporary file) are left out.
    ///
    /// Errors: [`StorageError::Store`] (op `list`).
    pub async fn list_chunks(&self) -> Result<Vec<Listed<String>>> {
        self.list_named("chunks", Objects::chunk_of_key).await
    }

    async fn list_named<N>(
        &self,
        prefix: &str,
        name: fn(&str) -> Option<N>,
    ) -> Result<Vec<Listed<N>>> {
        let key = Key::from(prefix);
        let metas: Vec<object_store::ObjectMeta> = self
            .inner
            .list(Some(&key))
            .try_collect()
            .await
            .map_err(StorageError::store(StoreOp::List, &key))?;
        Ok(metas
            .into_iter()
            .filter_map(|m| {
                Some(Listed {
                    name: name(m.location.as_ref())?,
                    size: m.size,
                    last_modified: SystemTime::from(m.last_modified),
                })
            })
            .collect())
    }

    /// Every object below `prefix` (`chunks`, `manifests`) with its size in bytes.
    pub async fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>> {
        let key = Key::from(prefix);
        self.inner
            .list(Some(&key))
            .map_ok(|m| (m.location.to_string(), m.size))
            .try_collect()
            .await
            .map_err(StorageError::store(StoreOp::List, &key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn locations_parse_s3_file_and_plain_paths_and_refuse_the_rest() {
        assert_eq!(
            Location::parse("s3://snaps/berth/prod/").unwrap(),
            Location::S3 {
                bucket: "snaps".into(),
                prefix: "berth/prod".into()
            }
        );
        assert_eq!(
            Location::parse("s3://snaps").unwrap(),
            Location::S3 {
                bucket: "snaps".into(),
                prefix: String::new()
            }
        );
        assert_eq!(
            Location::parse("file:///var/lib/b").unwrap(),
            Location::Local("/var/lib/b".into())
        );
        assert_eq!(
            Location::parse("/var/lib/b").unwrap(),
            Location::Local("/var/lib/b".into())
        );
        for bad in [
            "s3://",
            "s3:///x",
            "s3://b/a/../c",
            "s3://b/a//c",
            "relative/dir",
            "gs://b",
            "file://rel",
        ] {
            assert!(
                matches!(Location::parse(bad), Err(StorageError::Config { .. })),
                "{bad}"
            );
        }
    }

    #[test]
    fn listed_keys_are_read_back_only_in_the_documented_layout() {
        let h = "ab".repeat(32);
        assert_eq!(
            Objects::chunk_of_key(&format!("chunks/ab/{h}.zst")),
            Some(h.clone())
        );
        let id = SnapshotId::new();
        assert_eq!(
            Objects::manifest_of_key(&format!("manifests/{id}.json")),
            Some(id)
        );
        for other in [
            format!("chunks/cd/{h}.zst"),
            format!("chunks/ab/{h}.zst#1"),
            format!("chunks/ab/{}.zst", "AB".repeat(32)),
            "chunks/ab/short.zst".to_owned(),
            format!("manifests/{id}.json.tmp"),
            "manifests/not-a-uuid.json".to_owned(),
            format!("other/{id}.json"),
        ] {
            assert_eq!(Objects::chunk_of_key(&other), None, "{other}");
            assert_eq!(Objects::manifest_of_key(&other), None, "{other}");
        }
    }

    #[test]
    fn keys_follow_the_documented_layout() {
        let h = "ab".repeat(32);
        assert_eq!(
            Objects::chunk_key(&h).to_string(),
            format!("chunks/ab/{h}.zst")
        );
        let id = SnapshotId::new();
        assert_eq!(
            Objects::manifest_key(id).to_string(),
            format!("manifests/{id}.json")
        );
    }
}
