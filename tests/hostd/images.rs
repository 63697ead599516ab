//! Templates from OCI images, against a real registry (`docker-registry` on loopback, images
//! pushed with `skopeo` from OCI layouts built here): the image cache (layers with deleted
//! files and opaque dirs, layers shared between images), every pull error as a typed error,
//! hostile images refused with nothing left behind, and `POST /v1/templates` end to end: the
//! template's states and events, and sandboxes on runc and gVisor booted from it with its files.

use std::path::{Path, PathBuf};
use std::time::Duration;

use berth_hostd::image::{resolve, ImageCache, ImageError, ImageLimits, PullProgress};
use reqwest::Method;
use serde_json::{json, Value};
use sqlx::PgPool;

use crate::support::env::unique;
use crate::support::registry::{busybox_layer, tar_of, write_layout, Entry, Registry};
use crate::support::Stack;

/// The layers of the multi-layer test image: busybox, then files, then a layer that deletes a
/// file, hides a directory's earlier children (opaque) and adds files.
fn multi_layer_image() -> Vec<Vec<u8>> {
    let files = tar_of(&[
        Entry::Dir("data/"),
        Entry::File("data/keep", b"kept\n", false),
        Entry::File("data/deleted", b"deleted\n", false),
        Entry::Dir("olddir/"),
        Entry::File("olddir/a", b"a\n", false),
        Entry::File("olddir/b", b"b\n", false),
    ]);
    let changes = tar_of(&[
        Entry::File("data/.wh.deleted", b"", false),
        Entry::Dir("olddir/"),
        Entry::File("olddir/.wh..wh..opq", b"", false),
        Entry::File("olddir/c", b"c\n", false),
        Entry::File("etc/motd", b"from the image\n", false),
    ]);
    vec![busybox_layer(), files, changes]
}

/// A scratch dir removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("berth-{what}-{}", unique()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Builds an image layout in `scratch` and pushes it as `repo:1`; returns its reference.
fn push(registry: &Registry, scratch: &Path, repo: &str, layers: &[Vec<u8>], arch: &str) -> String {
    let layout = scratch.join(format!("layout-{repo}"));
    write_layout(&layout, "1", layers, arch, &["/bin/sh"]);
    registry.push(&layout, "1", repo);
    registry.reference(repo, "1")
}

fn names_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn a_multi_layer_image_unpacks_with_its_deletions_and_shares_layers_between_images() {
    let registry = Registry::start().await;
    let scratch = Scratch::new("image-cache");
    let layers = multi_layer_image();
    let multi = push(&registry, &scratch.0, "multi", &layers, "amd64");
    // A second image sharing the busybox layer.
    let other_top = tar_of(&[Entry::File("etc/motd", b"other\n", false)]);
    let other = push(
        &registry,
        &scratch.0,
        "other",
        &[layers[0].clone(), other_top],
        "amd64",
    );

    let cache = ImageCache::new(scratch.0.join("cache"));
    let limits = ImageLimits::default();
    let mut steps = Vec::new();
    let pulled = cache
        .ensure_rootfs(&multi, &limits, |p| steps.push(p))
        .await
        .unwrap();
    let root = &pulled.rootfs;
    assert_eq!(
        std::fs::read(root.join("etc/motd")).unwrap(),
        b"from the image\n"
    );
    assert_eq!(std::fs::read(root.join("data/keep")).unwrap(), b"kept\n");
    assert!(!root.join("data/deleted").exists(), "a whiteout deletes");
    assert_eq!(names_in(&root.join("olddir")), ["c"], "an opaque dir hides");
    assert!(root.join("bin/busybox").is_file());
    assert!(pulled.pinned.contains("@sha256:"), "{}", pulled.pinned);
    assert_eq!(pulled.config.entrypoint, ["/bin/sh"]);
    let downloaded: Vec<bool> = steps
        .iter()
        .filter_map(|p| match p {
            PullProgress::Layer { cached, .. } => Some(*cached),
            _ => None,
        })
        .collect();
    assert_eq!(downloaded, [false, false, false], "{steps:?}");
    assert_eq!(steps.last(), Some(&PullProgress::Ready));

    // Pulled again (by tag or by its pinned digest): the same root, nothing downloaded.
    let mut again = Vec::new();
    let second = cache
        .ensure_rootfs(&pulled.pinned, &limits, |p| again.push(p))
        .await
        .unwrap();
    assert_eq!(second.rootfs, pulled.rootfs);
    assert!(
        !again
            .iter()
            .any(|p| matches!(p, PullProgress::Layer { .. })),
        "{again:?}"
    );

    // The other image finds the shared layer in the cache.
    let mut steps = Vec::new();
    let other = cache
        .ensure_rootfs(&other, &limits, |p| steps.push(p))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(other.rootfs.join("etc/motd")).unwrap(),
        b"other\n"
    );
    let cached: Vec<bool> = steps
        .iter()
        .filter_map(|p| match p {
            PullProgress::Layer { cached, .. } => Some(*cached),
            _ => None,
        })
        .collect();
    assert_eq!(cached, [true, false], "{steps:?}");
}

#[tokio::test]
async fn pull_errors_are_typed_and_hostile_images_leave_nothing_behind() {
    let registry = Registry::start().await;
    let scratch = Scratch::new("image-errors");
    let limits = ImageLimits::default();

    // Unknown repository, unknown tag of a known repository.
    match resolve(&registry.reference("nothing-here", "1"), &limits).await {
        Err(e @ ImageError::UnknownImage { .. }) => assert_eq!(e.code(), "unknown_image"),
        other => panic!("expected unknown_image, got {other:?}"),
    }
    let known = push(&registry, &scratch.0, "known", &[busybox_layer()], "amd64");
    let unknown_tag = registry.reference("known", "2");
    assert!(matches!(
        resolve(&unknown_tag, &limits).await,
        Err(ImageError::UnknownImage { .. })
    ));

    // A registry that wants credentials.
    let locked = Registry::start_with_auth().await;
    match resolve(&locked.reference("known", "1"), &limits).await {
        Err(e @ ImageError::AuthFailed { .. }) => assert_eq!(e.code(), "auth_failed"),
        other => panic!("expected auth_failed, got {other:?}"),
    }

    // An image for another platform.
    let arm = push(&registry, &scratch.0, "arm", &[busybox_layer()], "arm64");
    match resolve(&arm, &limits).await {
        Err(e @ ImageError::UnsupportedPlatform { .. }) => {
            assert_eq!(e.code(), "unsupported_platform");
            assert!(e.to_string().contains("linux/arm64"), "{e}");
        }
        other => panic!("expected unsupported_platform, got {other:?}"),
    }

    // Nobody listening: a transient registry error.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let err = resolve(&format!("{closed}/x:1"), &limits)
        .await
        .unwrap_err();
    assert!(err.is_transient(), "{err:?}");

    // Bounds: compressed size at resolve, unpacked size at unpack.
    let tight = ImageLimits {
        max_compressed_bytes: 1024,
        ..limits
    };
    assert!(matches!(
        resolve(&known, &tight).await,
        Err(ImageError::TooLarge { .. })
    ));
    let huge = push(
        &registry,
        &scratch.0,
        "huge",
        &[tar_of(&[Entry::File("zeros", &vec![0u8; 8 << 20], false)])],
        "amd64",
    );
    let small_unpack = ImageLimits {
        unpack: berth_hostd::image::unpack::UnpackLimits {
            max_bytes: 1 << 20,
            max_entries: 1000,
        },
        ..limits
    };
    let cache = ImageCache::new(scratch.0.join("cache"));
    let err = cache
        .ensure_rootfs(&huge, &small_unpack, |_| {})
        .await
        .unwrap_err();
    assert_eq!(err.code(), "image_too_large", "{err:?}");

    // Hostile layers: a path climbing out, a device node.
    let outside = scratch.0.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    let outside_str = outside.to_str().unwrap();
    let escape = format!("../../../../../../../..{outside_str}/escaped");
    let hostile: Vec<(&str, Vec<u8>)> = vec![
        ("dotdot", tar_of(&[Entry::File(&escape, b"x", false)])),
        ("device", tar_of(&[Entry::CharDevice("dev/kmem", 1, 2)])),
    ];
    for (repo, layer) in hostile {
        let reference = push(
            &registry,
            &scratch.0,
            repo,
            &[busybox_layer(), layer],
            "amd64",
        );
        match cache.ensure_rootfs(&reference, &limits, |_| {}).await {
            Err(e @ ImageError::Hostile { .. }) => assert_eq!(e.code(), "hostile_layer"),
            other => panic!("{repo}: expected hostile_layer, got {other:?}"),
        }
    }
    // A symlink out of the root is followed inside it, as the sandbox sees it.
    let through = tar_of(&[
        Entry::Symlink("out", outside_str),
        Entry::File("out/planted", b"x", false),
    ]);
    let reference = push(
        &registry,
        &scratch.0,
        "symlink",
        &[busybox_layer(), through],
        "amd64",
    );
    let pulled = cache
        .ensure_rootfs(&reference, &limits, |_| {})
        .await
        .unwrap();
    let inside = pulled
        .rootfs
        .join(outside_str.trim_start_matches('/'))
        .join("planted");
    assert_eq!(std::fs::read(inside).unwrap(), b"x");
    assert!(names_in(&outside).is_empty(), "nothing was written outside");
    std::fs::remove_dir_all(
        scratch
            .0
            .join("cache/images")
            .join(pulled.digest.trim_start_matches("sha256:")),
    )
    .unwrap();
    // No root of a refused image is left where a sandbox could use it, nor a temporary one.
    let images = scratch.0.join("cache/images");
    assert!(
        names_in(&images).iter().all(|n| n.ends_with(".lock")),
        "{:?}",
        names_in(&images)
    );
}

/// Polls `GET /v1/templates/{name}` until its state is not `pulling`.
async fn settled_template(stack: &Stack, name: &str) -> Value {
    let deadline = tokio::time::Instant::now() + crate::support::env::SETTLE_TIMEOUT;
    loop {
        let (status, body) = stack
            .call(Method::GET, &format!("/v1/templates/{name}"), None)
            .await;
        assert_eq!(status, 200, "{body}");
        if body["state"] != "pulling" {
            return body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still pulling: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_template_pulled_from_a_registry_boots_on_runc_and_gvisor_with_its_files(db: PgPool) {
    let registry = Registry::start().await;
    let scratch = Scratch::new("image-e2e");
    let image = push(
        &registry,
        &scratch.0,
        "multi",
        &multi_layer_image(),
        "amd64",
    );
    let stack = Stack::start(db, 1).await;
    // Templates are shared by every org: only an operator registers them.
    let operator = berth_api::auth::create_admin_key(&stack.db).await.unwrap();
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/templates",
            Some(json!({"name": format!("tenant-{}", unique()), "image": image})),
        )
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (403, Some("forbidden")),
        "{body}"
    );

    let mut sandboxes = Vec::new();
    for runtime in ["runc", "runsc"] {
        let name = format!("img-{runtime}-{}", unique());
        let (status, body) = stack
            .call_as(
                &operator,
                Method::POST,
                "/v1/templates",
                Some(json!({"name": name, "image": image, "runtime": runtime})),
            )
            .await;
        assert_eq!(status, 202, "{body}");
        assert_eq!(body["image"], image.as_str());
        let template = settled_template(&stack, &name).await;
        assert_eq!(template["state"], "ready", "{template}");
        assert!(template["image_digest"]
            .as_str()
            .unwrap()
            .starts_with("sha256:"));
        assert_eq!(template["entrypoint"], json!(["/bin/sh"]));
        let events: Vec<&str> = template["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["type"].as_str().unwrap())
            .collect();
        assert_eq!(events.first(), Some(&"template.pulling"), "{template}");
        assert_eq!(events.last(), Some(&"template.ready"), "{template}");
        assert!(events.contains(&"template.progress"), "{template}");
        // Asking again is idempotent.
        let (status, again) = stack
            .call_as(
                &operator,
                Method::POST,
                "/v1/templates",
                Some(json!({"name": name, "image": image, "runtime": runtime})),
            )
            .await;
        assert_eq!((status, &again["state"]), (202, &json!("ready")), "{again}");

        let (status, body) = stack
            .call(
                Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": name, "vcpus": 1, "memory_mib": 256})),
            )
            .await;
        assert_eq!(status, 202, "{body}");
        let id = body["id"].as_str().unwrap().to_owned();
        stack.wait_state(&id, "running").await;
        let (_, out) = stack.exec(&id, &["cat", "/etc/motd", "/data/keep"]).await;
        assert_eq!(out["stdout"], "from the image\nkept\n", "{runtime}: {out}");
        let (_, out) = stack.exec(&id, &["ls", "/olddir"]).await;
        assert_eq!(out["stdout"], "c\n", "{runtime}: {out}");
        let (_, out) = stack.exec(&id, &["test", "-e", "/data/deleted"]).await;
        assert_eq!(
            out["exit_code"], 1,
            "{runtime}: a deleted file is gone: {out}"
        );
        sandboxes.push(id);
    }

    // A template whose image does not exist fails with its code, and creates are refused.
    let (status, body) = stack
        .call_as(
            &operator,
            Method::POST,
            "/v1/templates",
            Some(json!({"name": format!("missing-{}", unique()), "image": registry.reference("nope", "1")})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let name = body["name"].as_str().unwrap().to_owned();
    let failed = settled_template(&stack, &name).await;
    assert_eq!(failed["state"], "failed", "{failed}");
    assert_eq!(failed["error_code"], "unknown_image", "{failed}");
    assert_eq!(
        failed["events"].as_array().unwrap().last().unwrap()["type"],
        "template.failed"
    );
    let (status, body) = stack
        .call(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": name})),
        )
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("template_not_ready")),
        "{body}"
    );

    // Bad requests, and a taken name.
    for bad in [
        json!({"name": "Bad Name", "image": image}),
        json!({"name": "fine", "image": "has space:1"}),
        json!({"name": "fine", "image": image, "runtime": "kata"}),
        json!({"name": "fine", "image": image, "surprise": true}),
    ] {
        let (status, body) = stack
            .call_as(&operator, Method::POST, "/v1/templates", Some(bad.clone()))
            .await;
        assert_eq!(status, 400, "{bad}: {body}");
    }
    let (status, body) = stack
        .call_as(
            &operator,
            Method::POST,
            "/v1/templates",
            Some(json!({"name": "base", "image": image})),
        )
        .await;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (409, Some("template_exists")),
        "{body}"
    );

    for id in &sandboxes {
        stack.delete(id).await;
        stack.wait_state(id, "deleted").await;
        stack.nothing_left(id).await;
    }
    stack.teardown().await;
}
