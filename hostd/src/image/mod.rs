//! Templates from OCI images: resolving an image reference in a registry to a digest
//! ([`resolve`]), pulling its layers by digest into a content-addressed cache shared by every
//! template of the machine, and unpacking them (with whiteouts) into a cached root filesystem
//! ([`ImageCache::ensure_rootfs`]).
//!
//! The registry is spoken to through `oci-client` (OCI distribution spec), anonymously. A
//! registry on a loopback address is spoken to over plain HTTP, as Docker treats
//! `127.0.0.0/8` as an insecure registry by default; every other one over HTTPS.
//!
//! # Layout of the cache (`<cache>/oci/`)
//! - `blobs/sha256/<hex>`: layer blobs, verified against their digest before they land there
//!   (renamed into place), shared between images.
//! - `images/<hex of the manifest digest>/rootfs`: an image's unpacked root, built aside and
//!   renamed into place, so a crash never leaves half a root where a sandbox could use it;
//!   `image.json` beside it keeps the image's config ([`ImageConfig`]).
//!
//! # Errors
//! [`ImageError`]; [`ImageError::code`] gives each a stable snake_case code that template
//! states and events carry (`unknown_image`, `auth_failed`, `unsupported_platform`, ...).

mod cache;
mod pull;
pub mod unpack;

pub use cache::{read_config, ImageCache, PullProgress, Pulled};
pub use pull::{resolve, Resolved};

use serde::{Deserialize, Serialize};

/// The most layers an image may have.
pub const MAX_LAYERS: usize = 128;

/// The largest compressed size of all layers of an image, in bytes (4 GiB).
pub const MAX_COMPRESSED_BYTES: u64 = 4 << 30;

/// The largest unpacked size of all layers of an image, in bytes (16 GiB).
pub const MAX_UNPACKED_BYTES: u64 = 16 << 30;

/// The most entries (files, dirs, links) all layers of an image may hold.
pub const MAX_ENTRIES: u64 = 2_000_000;

/// The largest image config blob, in bytes.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// Bounds on one image; [`ImageLimits::default`] gives the constants above.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageLimits {
    /// At most this many layers.
    pub max_layers: usize,
    /// At most this many compressed bytes of layers (the manifest's sizes, enforced while
    /// downloading too).
    pub max_compressed_bytes: u64,
    /// What the layers may unpack to.
    pub unpack: unpack::UnpackLimits,
}

impl Default for ImageLimits {
    fn default() -> Self {
        Self {
            max_layers: MAX_LAYERS,
            max_compressed_bytes: MAX_COMPRESSED_BYTES,
            unpack: unpack::UnpackLimits {
                max_bytes: MAX_UNPACKED_BYTES,
                max_entries: MAX_ENTRIES,
            },
        }
    }
}

/// What an image's config says about running it (OCI image spec `config.md`), kept beside its
/// root. Berth runs the entrypoint only when a create asks for it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageConfig {
    /// `Entrypoint`.
    #[serde(default)]
    pub entrypoint: Vec<String>,
    /// `Cmd`.
    #[serde(default)]
    pub cmd: Vec<String>,
    /// `Env`, `NAME=value` each.
    #[serde(default)]
    pub env: Vec<String>,
    /// `WorkingDir`.
    #[serde(default)]
    pub working_dir: String,
}

/// Why an image could not be resolved, pulled or unpacked.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The reference does not parse (`registry/repo:tag` or `registry/repo@sha256:...`).
    #[error("bad image reference {reference:?}: {reason}")]
    BadReference {
        /// As given.
        reference: String,
        /// Why.
        reason: String,
    },
    /// The registry has no such repository, tag or digest.
    #[error("image {reference} not found in its registry")]
    UnknownImage {
        /// The reference.
        reference: String,
    },
    /// The registry wants credentials Berth does not have, or refused them.
    #[error("registry {registry} refused access to {reference} (Berth pulls anonymously)")]
    AuthFailed {
        /// The registry host.
        registry: String,
        /// The reference.
        reference: String,
    },
    /// The image has no variant for this machine's platform.
    #[error("image {reference} has no {wanted} variant (it has: {offered})")]
    UnsupportedPlatform {
        /// The reference.
        reference: String,
        /// `linux/amd64` or the like.
        wanted: String,
        /// What the image offers, comma-separated.
        offered: String,
    },
    /// The image is bigger than [`ImageLimits`] allow.
    #[error("image too large: more {what} than {limit}")]
    TooLarge {
        /// What was counted.
        what: &'static str,
        /// The limit.
        limit: u64,
    },
    /// A layer of a media type Berth does not unpack (zstd, foreign layers).
    #[error("unsupported layer media type {media_type}")]
    UnsupportedLayer {
        /// The media type.
        media_type: String,
    },
    /// A layer entry that would escape the root or plant a device.
    #[error("layer {layer} refused at {path}: {reason}")]
    Hostile {
        /// The layer's blob name (its digest hex).
        layer: String,
        /// The entry's path in the layer.
        path: String,
        /// Why.
        reason: String,
    },
    /// The registry failed otherwise (unreachable, 5xx, a digest mismatch, a bad manifest).
    #[error("registry error for {reference}: {message}")]
    Registry {
        /// The reference.
        reference: String,
        /// What went wrong.
        message: String,
    },
    /// A local filesystem operation failed.
    #[error("{context}")]
    Io {
        /// What was being done, on what.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl ImageError {
    /// The stable code of this error, for template states, events and API errors.
    pub fn code(&self) -> &'static str {
        match self {
            Self::BadReference { .. } => "bad_reference",
            Self::UnknownImage { .. } => "unknown_image",
            Self::AuthFailed { .. } => "auth_failed",
            Self::UnsupportedPlatform { .. } => "unsupported_platform",
            Self::TooLarge { .. } => "image_too_large",
            Self::UnsupportedLayer { .. } => "unsupported_layer",
            Self::Hostile { .. } => "hostile_layer",
            Self::Registry { .. } => "registry_error",
            Self::Io { .. } => "io_error",
        }
    }

    /// Whether trying again later may succeed (the registry or the disk failed), as opposed
    /// to the image itself being unusable.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Registry { .. } | Self::Io { .. })
    }

    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> ImageError {
        let context = context.into();
        move |source| ImageError::Io { context, source }
    }
}

/// This machine's platform as OCI names it (`linux/amd64`, `linux/arm64`).
pub fn host_platform() -> (&'static str, &'static str) {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "x86" => "386",
        other => other,
    };
    ("linux", arch)
}
