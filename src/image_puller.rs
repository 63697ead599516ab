//! The API's [`ImagePuller`]: hostd's image cache ([`berth_hostd::image`]) on this machine, so
//! a template's pull (`POST /v1/templates`) resolves, downloads and unpacks the image where
//! this machine's hostd find it, and fails the template (not a sandbox) when the image is
//! unusable.

use std::path::Path;

use berth_api::templates::{ImagePuller, PullFailure, PulledImage};
use berth_hostd::image::{ImageCache, ImageLimits, PullProgress};
use futures::future::BoxFuture;
use tokio::sync::mpsc;

/// Pulls into the image cache of the template cache dir `cache` (hostd's `template_cache`).
#[derive(Debug, Clone)]
pub struct CachePuller {
    cache: ImageCache,
    limits: ImageLimits,
}

impl CachePuller {
    /// A puller into `<cache>/oci`, with the default [`ImageLimits`].
    pub fn new(cache: &Path) -> Self {
        Self::with_limits(cache, ImageLimits::default())
    }

    /// A puller into `<cache>/oci` bounded by `limits`.
    pub fn with_limits(cache: &Path, limits: ImageLimits) -> Self {
        Self {
            cache: ImageCache::new(cache.join(berth_hostd::template::IMAGE_CACHE_DIR)),
            limits,
        }
    }
}

impl ImagePuller for CachePuller {
    fn pull(
        &self,
        image: String,
        progress: mpsc::UnboundedSender<String>,
    ) -> BoxFuture<'static, Result<PulledImage, PullFailure>> {
        let (cache, limits) = (self.cache.clone(), self.limits);
        Box::pin(async move {
            let report = |p: PullProgress| {
                let line = match &p {
                    PullProgress::Resolved {
                        digest,
                        layers,
                        bytes,
                    } => format!("resolved to {digest}: {layers} layers, {bytes} bytes"),
                    PullProgress::Layer {
                        index,
                        digest,
                        bytes,
                        cached,
                    } => format!(
                        "layer {} {digest} ({bytes} bytes) {}",
                        index + 1,
                        if *cached { "was cached" } else { "downloaded" }
                    ),
                    PullProgress::Ready => "unpacked".to_owned(),
                };
                let _ = progress.send(line);
            };
            let result = cache.ensure_rootfs(&image, &limits, report).await;
            drop(progress);
            match result {
                Ok(pulled) => Ok(PulledImage {
                    pinned: pulled.pinned,
                    digest: pulled.digest,
                    bytes: pulled.compressed_bytes,
                    entrypoint: pulled
                        .config
                        .entrypoint
                        .into_iter()
                        .chain(pulled.config.cmd)
                        .collect(),
                }),
                Err(e) => Err(failure(e)),
            }
        })
    }

    fn remove(&self, digest: String) -> BoxFuture<'static, Result<bool, String>> {
        self.remove_root(digest)
    }
}

impl CachePuller {
    /// See [`ImagePuller::remove`].
    fn remove_root(&self, digest: String) -> BoxFuture<'static, Result<bool, String>> {
        let cache = self.cache.clone();
        Box::pin(async move { cache.remove_image(&digest).await.map_err(|e| e.to_string()) })
    }
}

fn failure(e: berth_hostd::image::ImageError) -> PullFailure {
    PullFailure {
        code: e.code().to_owned(),
        message: e.to_string(),
    }
}
