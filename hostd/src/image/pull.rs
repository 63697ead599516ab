//! The registry side: resolving a reference to this platform's manifest digest, and
//! downloading blobs by digest, bounded and verified.

use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::{OciDescriptor, OciManifest};
use oci_client::secrets::RegistryAuth;
use oci_client::{Client, Reference};
use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;

use super::{host_platform, ImageConfig, ImageError, ImageLimits};

/// How long connecting to a registry may take.
pub const REGISTRY_CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// How long a registry may stay silent while answering.
pub const REGISTRY_READ_TIMEOUT: Duration = Duration::from_secs(60);

/// One layer of a resolved image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    /// `sha256:<hex>`.
    pub digest: String,
    /// Compressed size in bytes, from the manifest.
    pub size: u64,
    /// Its media type.
    pub media_type: String,
}

/// An image reference resolved to this platform's manifest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// The reference pinned to the manifest digest (`registry/repo@sha256:...`): what hosts
    /// pull, so every host gets the same bytes whatever the tag points to later.
    pub pinned: String,
    /// The manifest digest (`sha256:<hex>`).
    pub digest: String,
    /// The layers, lowest first.
    pub layers: Vec<Layer>,
    /// The sum of the layers' compressed sizes, in bytes.
    pub compressed_bytes: u64,
    /// The image's run config.
    pub config: ImageConfig,
}

/// A client for the registry of `reference`: plain HTTP for a loopback registry, HTTPS
/// otherwise; this platform picked from image indexes by [`resolve`] itself.
pub(super) fn client_for(reference: &Reference) -> Client {
    let registry = reference.resolve_registry().to_owned();
    let host = registry
        .rsplit_once(':')
        .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
        .map_or(registry.as_str(), |(host, _)| host)
        .trim_start_matches('[')
        .trim_end_matches(']');
    let loopback = host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback());
    Client::new(ClientConfig {
        protocol: if loopback {
            ClientProtocol::HttpsExcept(vec![registry])
        } else {
            ClientProtocol::Https
        },
        platform_resolver: None,
        connect_timeout: Some(REGISTRY_CONNECT_TIMEOUT),
        read_timeout: Some(REGISTRY_READ_TIMEOUT),
        ..Default::default()
    })
}

/// Parses `reference` (`registry/repo:tag`, `registry/repo@sha256:...`; no registry means
/// Docker Hub, as in Docker).
///
/// Errors: [`ImageError::BadReference`].
pub(super) fn parse(reference: &str) -> Result<Reference, ImageError> {
    reference
        .parse::<Reference>()
        .map_err(|e| ImageError::BadReference {
            reference: reference.to_owned(),
            reason: e.to_string(),
        })
}

/// Resolves `reference` to this platform's image manifest: its digest, layers and config,
/// checked against `limits` (layer count, compressed size, layer media types).
///
/// Errors: [`ImageError::BadReference`], [`ImageError::UnknownImage`],
/// [`ImageError::AuthFailed`], [`ImageError::UnsupportedPlatform`] (no variant for
/// [`host_platform`] in an index, or a single manifest built for another),
/// [`ImageError::TooLarge`], [`ImageError::UnsupportedLayer`], [`ImageError::Registry`].
pub async fn resolve(reference: &str, limits: &ImageLimits) -> Result<Resolved, ImageError> {
    let image = parse(reference)?;
    let client = client_for(&image);
    let auth = RegistryAuth::Anonymous;
    let fail = |e| registry_error(&image, e);
    let (manifest, mut digest) = client.pull_manifest(&image, &auth).await.map_err(fail)?;
    let (os, arch) = host_platform();
    let wanted = format!("{os}/{arch}");
    let manifest = match manifest {
        OciManifest::Image(m) => m,
        OciManifest::ImageIndex(index) => {
            let entry = index
                .manifests
                .iter()
                .find(|m| {
                    m.platform
                        .as_ref()
                        .is_some_and(|p| p.os == os && p.architecture == arch)
                })
                .ok_or_else(|| ImageError::UnsupportedPlatform {
                    reference: reference.to_owned(),
                    wanted: wanted.clone(),
                    offered: index
                        .manifests
                        .iter()
                        .filter_map(|m| m.platform.as_ref())
                        .map(|p| format!("{}/{}", p.os, p.architecture))
                        .collect::<Vec<_>>()
                        .join(", "),
                })?;
            digest = entry.digest.clone();
            match client
                .pull_manifest(&image.clone_with_digest(digest.clone()), &auth)
                .await
                .map_err(fail)?
            {
                (OciManifest::Image(m), _) => m,
                (OciManifest::ImageIndex(_), _) => {
                    return Err(ImageError::Registry {
                        reference: reference.to_owned(),
                        message: "an image index names another index for this platform".into(),
                    })
                }
            }
        }
    };
    if manifest.layers.len() > limits.max_layers {
        return Err(ImageError::TooLarge {
            what: "layers",
            limit: limits.max_layers as u64,
        });
    }
    let mut layers = Vec::with_capacity(manifest.layers.len());
    let mut compressed_bytes = 0u64;
    for layer in &manifest.layers {
        super::unpack::Compression::of(&layer.media_type)?;
        let size = u64::try_from(layer.size).unwrap_or(u64::MAX);
        compressed_bytes = compressed_bytes.saturating_add(size);
        if compressed_bytes > limits.max_compressed_bytes {
            return Err(ImageError::TooLarge {
                what: "compressed bytes of layers",
                limit: limits.max_compressed_bytes,
            });
        }
        layers.push(Layer {
            digest: layer.digest.clone(),
            size,
            media_type: layer.media_type.clone(),
        });
    }
    let config = pull_config(&client, &image, &manifest.config, reference).await?;
    if config.os != os || config.architecture != arch {
        return Err(ImageError::UnsupportedPlatform {
            reference: reference.to_owned(),
            wanted,
            offered: format!("{}/{}", config.os, config.architecture),
        });
    }
    let pinned = Reference::with_digest(
        image.registry().to_owned(),
        image.repository().to_owned(),
        digest.clone(),
    )
    .whole();
    Ok(Resolved {
        pinned,
        digest,
        layers,
        compressed_bytes,
        config: config.run,
    })
}

/// The parts of an image config blob Berth reads.
struct Config {
    os: String,
    architecture: String,
    run: ImageConfig,
}

async fn pull_config(
    client: &Client,
    image: &Reference,
    descriptor: &OciDescriptor,
    reference: &str,
) -> Result<Config, ImageError> {
    #[derive(serde::Deserialize)]
    struct Blob {
        #[serde(default)]
        os: String,
        #[serde(default)]
        architecture: String,
        #[serde(default)]
        config: Option<Run>,
    }
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Run {
        #[serde(default)]
        entrypoint: Option<Vec<String>>,
        #[serde(default)]
        cmd: Option<Vec<String>>,
        #[serde(default)]
        env: Option<Vec<String>>,
        #[serde(default)]
        working_dir: Option<String>,
    }
    if u64::try_from(descriptor.size).unwrap_or(u64::MAX) > super::MAX_CONFIG_BYTES {
        return Err(ImageError::TooLarge {
            what: "bytes of image config",
            limit: super::MAX_CONFIG_BYTES,
        });
    }
    let mut bytes = Vec::new();
    client
        .pull_blob(image, descriptor, &mut bytes)
        .await
        .map_err(|e| registry_error(image, e))?;
    let blob: Blob = serde_json::from_slice(&bytes).map_err(|e| ImageError::Registry {
        reference: reference.to_owned(),
        message: format!("image config is not valid JSON: {e}"),
    })?;
    let run = blob.config.unwrap_or(Run {
        entrypoint: None,
        cmd: None,
        env: None,
        working_dir: None,
    });
    Ok(Config {
        os: blob.os,
        architecture: blob.architecture,
        run: ImageConfig {
            entrypoint: run.entrypoint.unwrap_or_default(),
            cmd: run.cmd.unwrap_or_default(),
            env: run.env.unwrap_or_default(),
            working_dir: run.working_dir.unwrap_or_default(),
        },
    })
}

/// Downloads blob `layer` of `image` into `dest` (created), stopping past its manifest size
/// and verifying its sha256 digest; `progress` gets the bytes written so far.
///
/// Errors: [`ImageError::Registry`] for a refused request, a short or long body or a digest
/// mismatch; [`ImageError::Io`].
pub(super) async fn download(
    client: &Client,
    image: &Reference,
    layer: &Layer,
    dest: &Path,
    mut progress: impl FnMut(u64),
) -> Result<(), ImageError> {
    let expected = layer
        .digest
        .strip_prefix("sha256:")
        .filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()))
        .ok_or_else(|| ImageError::Registry {
            reference: image.whole(),
            message: format!("layer digest {} is not sha256", layer.digest),
        })?;
    let descriptor = OciDescriptor {
        media_type: layer.media_type.clone(),
        digest: layer.digest.clone(),
        size: i64::try_from(layer.size).unwrap_or(i64::MAX),
        ..Default::default()
    };
    let mut stream = client
        .pull_blob_stream(image, &descriptor)
        .await
        .map_err(|e| registry_error(image, e))?;
    let mut file = tokio::fs::File::create(dest)
        .await
        .map_err(ImageError::io(format!("create {}", dest.display())))?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    let bad = |message: String| ImageError::Registry {
        reference: image.whole(),
        message,
    };
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| bad(format!("layer {}: {e}", layer.digest)))?;
        written += chunk.len() as u64;
        if written > layer.size {
            return Err(bad(format!(
                "layer {} is longer than its manifest size {}",
                layer.digest, layer.size
            )));
        }
        hasher.update(&chunk);
        file.write_all(&chunk)
            .await
            .map_err(ImageError::io(format!("write {}", dest.display())))?;
        progress(written);
    }
    if written != layer.size || hex::encode(hasher.finalize()) != expected.to_ascii_lowercase() {
        return Err(bad(format!(
            "layer {} does not match its digest and size ({written} bytes read)",
            layer.digest
        )));
    }
    file.sync_all()
        .await
        .map_err(ImageError::io(format!("sync {}", dest.display())))
}

/// Maps an `oci-client` error to what it means for a template.
pub(super) fn registry_error(image: &Reference, e: OciDistributionError) -> ImageError {
    let reference = image.whole();
    let auth = || ImageError::AuthFailed {
        registry: image.resolve_registry().to_owned(),
        reference: reference.clone(),
    };
    match &e {
        OciDistributionError::UnauthorizedError { .. }
        | OciDistributionError::AuthenticationFailure(_) => auth(),
        OciDistributionError::ImageManifestNotFoundError(_) => ImageError::UnknownImage {
            reference: reference.clone(),
        },
        OciDistributionError::RegistryError { envelope, .. } => {
            let codes: Vec<&OciErrorCode> = envelope.errors.iter().map(|e| &e.code).collect();
            if codes
                .iter()
                .any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied))
            {
                auth()
            } else if codes.iter().any(|c| {
                matches!(
                    c,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::NotFound
                        | OciErrorCode::BlobUnknown
                )
            }) {
                ImageError::UnknownImage { reference }
            } else {
                ImageError::Registry {
                    reference,
                    message: e.to_string(),
                }
            }
        }
        OciDistributionError::ServerError { code: 404, .. } => {
            ImageError::UnknownImage { reference }
        }
        OciDistributionError::ServerError {
            code: 401 | 403, ..
        } => auth(),
        _ => ImageError::Registry {
            reference,
            message: e.to_string(),
        },
    }
}
