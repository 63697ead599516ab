//! The machine's image cache: layer blobs by digest, unpacked roots by manifest digest.

use std::fs;
use std::path::{Path, PathBuf};

use super::pull::{self, Layer, Resolved};
use super::unpack::{self, Compression, Unpacked};
use super::{ImageConfig, ImageError, ImageLimits};

/// The metadata file beside an image's `rootfs/`.
pub const IMAGE_META: &str = "image.json";

/// What a pull reports as it goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PullProgress {
    /// The reference resolved to a manifest of `layers` layers, `bytes` compressed.
    Resolved {
        /// The manifest digest.
        digest: String,
        /// Number of layers.
        layers: usize,
        /// Their compressed size, in bytes.
        bytes: u64,
    },
    /// Layer `index` (from 0, lowest first) is in the cache: downloaded now, or already there
    /// (`cached`).
    Layer {
        /// Its position.
        index: usize,
        /// Its digest.
        digest: String,
        /// Its compressed size, in bytes.
        bytes: u64,
        /// Whether it was in the cache already (shared with another image or an earlier pull).
        cached: bool,
    },
    /// The root is unpacked and in place.
    Ready,
}

/// An image in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pulled {
    /// Its unpacked root filesystem.
    pub rootfs: PathBuf,
    /// The reference pinned to the manifest digest (`registry/repo@sha256:...`).
    pub pinned: String,
    /// The manifest digest.
    pub digest: String,
    /// The compressed size of its layers, in bytes.
    pub compressed_bytes: u64,
    /// Its run config.
    pub config: ImageConfig,
}

/// Blobs and unpacked roots under one directory (`<template cache>/oci`).
#[derive(Debug, Clone)]
pub struct ImageCache {
    dir: PathBuf,
}

impl ImageCache {
    /// The cache in `dir` (created on first pull).
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    /// The blob file of `digest` (`sha256:<hex>`), whether present or not.
    pub fn blob_path(&self, digest: &str) -> PathBuf {
        self.dir
            .join("blobs/sha256")
            .join(digest.trim_start_matches("sha256:"))
    }

    /// The image dir of manifest `digest`: `rootfs/` and [`IMAGE_META`] inside.
    pub fn image_dir(&self, digest: &str) -> PathBuf {
        self.dir
            .join("images")
            .join(digest.trim_start_matches("sha256:"))
    }

    /// The root filesystem of `reference` (best pinned by digest), pulled and unpacked first
    /// unless the cache has it, with the image's config. Layers already in the cache are not
    /// downloaded again. Two pulls of one image (in this process or another) wait for each
    /// other through a lock file, and the second finds the root in place.
    ///
    /// Errors: every [`ImageError`]; on error nothing partial is left where a sandbox could use
    /// it (blobs and roots are renamed into place whole).
    pub async fn ensure_rootfs(
        &self,
        reference: &str,
        limits: &ImageLimits,
        mut progress: impl FnMut(PullProgress),
    ) -> Result<Pulled, ImageError> {
        // A reference pinned to a digest this cache has unpacked needs no registry: a host
        // boots its sandboxes while the registry is down.
        let parsed = pull::parse(reference)?;
        if let Some(digest) = parsed.digest() {
            let image_dir = self.image_dir(digest);
            let rootfs = image_dir.join("rootfs");
            if let (true, Some(config)) = (rootfs.is_dir(), read_config(&image_dir)) {
                progress(PullProgress::Ready);
                return Ok(Pulled {
                    rootfs,
                    pinned: parsed.whole(),
                    digest: digest.to_owned(),
                    compressed_bytes: 0,
                    config,
                });
            }
        }
        let resolved = pull::resolve(reference, limits).await?;
        progress(PullProgress::Resolved {
            digest: resolved.digest.clone(),
            layers: resolved.layers.len(),
            bytes: resolved.compressed_bytes,
        });
        let image_dir = self.image_dir(&resolved.digest);
        let rootfs = image_dir.join("rootfs");
        if rootfs.is_dir() {
            progress(PullProgress::Ready);
            return Ok(pulled(rootfs, resolved));
        }
        let images = self.dir.join("images");
        let blobs = self.dir.join("blobs/sha256");
        for dir in [&images, &blobs] {
            fs::create_dir_all(dir).map_err(ImageError::io(format!("create {}", dir.display())))?;
        }
        let lock = lock(&images.join(format!(
            ".{}.lock",
            resolved.digest.trim_start_matches("sha256:")
        )))
        .await?;
        if rootfs.is_dir() {
            drop(lock);
            progress(PullProgress::Ready);
            return Ok(pulled(rootfs, resolved));
        }
        let image = pull::parse(&resolved.pinned)?;
        let client = pull::client_for(&image);
        for (index, layer) in resolved.layers.iter().enumerate() {
            let cached = self.fetch_blob(&client, &image, layer).await?;
            progress(PullProgress::Layer {
                index,
                digest: layer.digest.clone(),
                bytes: layer.size,
                cached,
            });
        }
        let built = self.unpack_aside(&resolved, limits).await;
        drop(lock);
        built?;
        progress(PullProgress::Ready);
        Ok(pulled(rootfs, resolved))
    }

    /// Removes the unpacked root of manifest `digest` (and the shifted copies runc sandboxes
    /// boot from, which live beside it), under the image's lock: renamed aside first, so no
    /// reader ever finds half a root, then deleted. Layer blobs are kept (content-addressed,
    /// possibly shared with other images). Returns whether there was a root to remove.
    ///
    /// The caller makes sure no sandbox of this machine uses the image (the API refuses to
    /// delete a template that sandboxes name).
    ///
    /// Errors: [`ImageError::Io`].
    pub async fn remove_image(&self, digest: &str) -> Result<bool, ImageError> {
        let hex = digest.trim_start_matches("sha256:").to_owned();
        if hex.is_empty() || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(false);
        }
        let images = self.dir.join("images");
        let dir = self.image_dir(digest);
        if !dir.is_dir() {
            return Ok(false);
        }
        let lock = lock(&images.join(format!(".{hex}.lock"))).await?;
        let aside = images.join(format!(".removing-{hex}-{}", std::process::id()));
        let renamed = fs::rename(&dir, &aside);
        drop(lock);
        match renamed {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(ImageError::io(format!("rename {}", dir.display()))(e)),
        }
        tokio::task::spawn_blocking(move || fs::remove_dir_all(&aside).map(|()| aside))
            .await
            .map_err(|e| ImageError::Io {
                context: "remove task".into(),
                source: std::io::Error::other(e),
            })?
            .map_err(ImageError::io(format!("remove the root of {digest}")))?;
        Ok(true)
    }

    /// Downloads `layer` into the blob store unless it is there; true when it was.
    async fn fetch_blob(
        &self,
        client: &oci_client::Client,
        image: &oci_client::Reference,
        layer: &Layer,
    ) -> Result<bool, ImageError> {
        let path = self.blob_path(&layer.digest);
        if path.is_file() {
            return Ok(true);
        }
        let tmp = path.with_file_name(format!(
            ".{}.tmp-{}",
            layer.digest.trim_start_matches("sha256:"),
            uuid::Uuid::new_v4().simple()
        ));
        let fetched = pull::download(client, image, layer, &tmp, |_| {})
            .await
            .and_then(|()| {
                fs::rename(&tmp, &path).map_err(ImageError::io(format!(
                    "rename {} into place",
                    tmp.display()
                )))
            });
        if fetched.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        fetched.map(|()| false)
    }

    /// Unpacks the image's layers into a temporary dir, then renames it into place.
    async fn unpack_aside(
        &self,
        resolved: &Resolved,
        limits: &ImageLimits,
    ) -> Result<(), ImageError> {
        let image_dir = self.image_dir(&resolved.digest);
        let tmp = image_dir.with_file_name(format!(
            ".{}.tmp-{}",
            resolved.digest.trim_start_matches("sha256:"),
            uuid::Uuid::new_v4().simple()
        ));
        let layers: Vec<(PathBuf, String)> = resolved
            .layers
            .iter()
            .map(|l| (self.blob_path(&l.digest), l.media_type.clone()))
            .collect();
        let config = resolved.config.clone();
        let limits = limits.unpack;
        let (tmp_in, image_dir_in) = (tmp.clone(), image_dir.clone());
        let built = tokio::task::spawn_blocking(move || -> Result<(), ImageError> {
            let rootfs = tmp_in.join("rootfs");
            fs::create_dir_all(&rootfs)
                .map_err(ImageError::io(format!("create {}", rootfs.display())))?;
            fs::set_permissions(&rootfs, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .map_err(ImageError::io(format!("chmod {}", rootfs.display())))?;
            let mut so_far = Unpacked::default();
            for (blob, media_type) in &layers {
                unpack::apply_layer(
                    &rootfs,
                    blob,
                    Compression::of(media_type)?,
                    &limits,
                    &mut so_far,
                )?;
            }
            let meta = serde_json::to_vec_pretty(&config).map_err(|e| ImageError::Io {
                context: "encode the image config".into(),
                source: std::io::Error::other(e),
            })?;
            fs::write(tmp_in.join(IMAGE_META), meta)
                .map_err(ImageError::io(format!("write {IMAGE_META}")))?;
            fs::rename(&tmp_in, &image_dir_in).map_err(ImageError::io(format!(
                "rename {} into place",
                tmp_in.display()
            )))
        })
        .await
        .map_err(|e| ImageError::Io {
            context: "unpack task".into(),
            source: std::io::Error::other(e),
        })
        .and_then(|r| r);
        if built.is_err() {
            let _ = fs::remove_dir_all(&tmp);
        }
        built
    }
}

fn pulled(rootfs: PathBuf, resolved: Resolved) -> Pulled {
    Pulled {
        rootfs,
        pinned: resolved.pinned,
        digest: resolved.digest,
        compressed_bytes: resolved.compressed_bytes,
        config: resolved.config,
    }
}

/// The image config kept beside an unpacked root, if it is there.
pub fn read_config(image_dir: &Path) -> Option<ImageConfig> {
    serde_json::from_slice(&fs::read(image_dir.join(IMAGE_META)).ok()?).ok()
}

/// An exclusive lock on `path` (created), taken off the async runtime.
async fn lock(path: &Path) -> Result<nix::fcntl::Flock<fs::File>, ImageError> {
    let file =
        fs::File::create(path).map_err(ImageError::io(format!("create {}", path.display())))?;
    let context = format!("lock {}", path.display());
    tokio::task::spawn_blocking(move || {
        nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| ImageError::io(context)(e.into()))
    })
    .await
    .map_err(|e| ImageError::Io {
        context: "lock task".into(),
        source: std::io::Error::other(e),
    })?
}
