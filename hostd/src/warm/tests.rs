//! The warm pool's unit tests: its config, shapes, memory share, claims and quiet wait.

use super::*;

fn spec(template: &str, memory_mib: u32) -> SandboxSpec {
    SandboxSpec {
        resources: Resources {
            vcpus: 1,
            memory_mib,
        },
        ..Shape {
            template: template.into(),
            runtime: Runtime::Runc,
            resources: Resources::default(),
            disk_mib: 64,
            image: None,
        }
        .pooled_spec()
    }
}

#[test]
fn sizes_parse_from_template_size_pairs() {
    let config: WarmConfig = "base=2, base-gvisor=1".parse().unwrap();
    assert_eq!(config.sizes.get("base"), Some(&2));
    assert_eq!(config.sizes.get("base-gvisor"), Some(&1));
    assert_eq!(config.to_string().parse::<WarmConfig>().unwrap(), config);
    assert_eq!("".parse::<WarmConfig>().unwrap(), WarmConfig::default());
    for bad in ["base", "base=x", "=2", "base=65", "base=-1"] {
        assert!(bad.parse::<WarmConfig>().is_err(), "{bad}");
    }
}

#[test]
fn a_pool_builds_its_templates_shape_up_to_its_size_once_a_create_showed_it() {
    let pool = WarmPool::new(&"base=2".parse().unwrap(), 8192);
    assert!(matches!(pool.next(), Action::Idle), "no shape yet");
    pool.learn(&spec("other", 512));
    assert!(matches!(pool.next(), Action::Idle), "not a pooled template");
    pool.learn(&spec("base", 512));
    let Action::Build(shape) = pool.next() else {
        panic!("no build")
    };
    assert_eq!(shape, Shape::of(&spec("base", 512)));
    for _ in 0..2 {
        let id = SandboxId::new();
        pool.inner().entries.insert(
            id,
            Entry {
                shape: shape.clone(),
                state: State::Building,
            },
        );
        pool.set(id, Some(State::Ready));
    }
    assert!(matches!(pool.next(), Action::Idle), "full");
    assert_eq!(pool.slots().len(), 2);
    assert_eq!(pool.held(), 1024);
}

#[test]
fn a_new_shape_replaces_the_entries_of_the_old_one() {
    let pool = WarmPool::new(&"base=1".parse().unwrap(), 65536);
    pool.learn(&spec("base", 512));
    let old = SandboxId::new();
    pool.inner().entries.insert(
        old,
        Entry {
            shape: Shape::of(&spec("base", 512)),
            state: State::Ready,
        },
    );
    pool.learn(&spec("base", 1024));
    assert!(matches!(pool.next(), Action::Remove(id) if id == old));
    assert!(
        pool.slots().is_empty(),
        "a sandbox being removed is not offered"
    );
    assert!(matches!(pool.next(), Action::Build(s) if s.resources.memory_mib == 1024));
}

/// Puts a ready entry of `shape` in `pool`; its id.
fn ready(pool: &WarmPool, shape: &Shape) -> SandboxId {
    let id = SandboxId::new();
    pool.inner().entries.insert(
        id,
        Entry {
            shape: shape.clone(),
            state: State::Ready,
        },
    );
    id
}

#[test]
fn one_odd_create_does_not_flip_a_templates_shape_but_a_majority_does() {
    let pool = WarmPool::new(&"base=1".parse().unwrap(), 8192);
    for _ in 0..3 {
        pool.learn(&spec("base", 512));
    }
    pool.learn(&spec("base", 12288));
    let shape = |pool: &WarmPool| pool.inner().shapes.get("base").cloned();
    assert_eq!(shape(&pool), Some(Shape::of(&spec("base", 512))));
    for _ in 0..3 {
        pool.learn(&spec("base", 256));
    }
    assert_eq!(
        shape(&pool),
        Some(Shape::of(&spec("base", 256))),
        "a tie keeps the newest"
    );
    for _ in 0..SHAPE_WINDOW {
        pool.learn(&spec("base", 128));
    }
    assert_eq!(shape(&pool), Some(Shape::of(&spec("base", 128))));
}

#[test]
fn a_pool_holds_at_most_its_share_of_the_hosts_memory() {
    // 8,192 MiB / 8: room for two of 512, never a 12 GiB one.
    let pool = WarmPool::new(&"base=4,big=1".parse().unwrap(), 8192);
    pool.learn(&spec("big", 12288));
    pool.learn(&spec("base", 512));
    let shape = Shape::of(&spec("base", 512));
    for _ in 0..2 {
        assert!(matches!(pool.next(), Action::Build(s) if s == shape));
        ready(&pool, &shape);
    }
    assert!(matches!(pool.next(), Action::Idle), "past the budget");
    assert_eq!(pool.held(), 1024);
}

#[test]
fn a_host_restarted_without_a_pool_offers_none_of_what_it_kept() {
    let record = |template: &str| {
        let mut r = SandboxRecord::new(
            SandboxId::new(),
            Shape::of(&spec(template, 512)).pooled_spec(),
            "runc",
            Generation(0),
        );
        r.warm = true;
        r.phase = Phase::Running;
        r
    };
    let kept = [record("base"), record("gone")];
    let pool = WarmPool::new(&"base=1".parse().unwrap(), 8192);
    pool.adopt(&kept, |_| true);
    let slots: Vec<SandboxId> = pool.slots().iter().map(|s| s.sandbox_id).collect();
    assert_eq!(
        slots,
        vec![kept[0].sandbox_id],
        "only a still pooled template's"
    );
    assert!(matches!(pool.next(), Action::Remove(id) if id == kept[1].sandbox_id));
    let off = WarmPool::new(&WarmConfig::default(), 8192);
    off.adopt(&kept, |_| true);
    assert!(
        off.slots().is_empty(),
        "a host without a pool offered what it kept"
    );
}

#[test]
fn a_pool_beyond_its_size_gives_the_extra_back() {
    let pool = WarmPool::new(&"base=1".parse().unwrap(), 8192);
    pool.learn(&spec("base", 512));
    let shape = Shape::of(&spec("base", 512));
    let (a, b) = (ready(&pool, &shape), ready(&pool, &shape));
    assert!(matches!(pool.next(), Action::Remove(id) if id == a || id == b));
    assert!(matches!(pool.next(), Action::Idle));
    assert_eq!(pool.slots().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_build_waits_for_the_host_to_be_quiet_but_not_forever() {
    let pool = WarmPool::new(&"base=1".parse().unwrap(), 8192);
    let started = tokio::time::Instant::now();
    pool.quiet().await;
    assert_eq!(
        started.elapsed(),
        Duration::ZERO,
        "a host that never ran anything is quiet"
    );
    drop(pool.busy());
    pool.quiet().await;
    assert!(
        started.elapsed() >= QUIET,
        "no pause after the last request"
    );
    let _held = pool.busy();
    let started = tokio::time::Instant::now();
    pool.quiet().await;
    assert!(
        started.elapsed() < MAX_DEFER + QUIET,
        "waited past the deferral bound"
    );
}

#[tokio::test]
async fn a_claim_takes_a_ready_sandbox_once_and_waits_out_a_removal() {
    let pool = Arc::new(WarmPool::new(&"base=1".parse().unwrap(), 8192));
    let ready = SandboxId::new();
    let removing = SandboxId::new();
    for (id, state) in [(ready, State::Ready), (removing, State::Removing)] {
        pool.inner().entries.insert(
            id,
            Entry {
                shape: Shape::of(&spec("base", 512)),
                state,
            },
        );
    }
    assert!(pool.claim(ready).await);
    assert!(!pool.claim(ready).await, "taken twice");
    assert!(!pool.claim(SandboxId::new()).await);
    let waiting = tokio::spawn({
        let pool = pool.clone();
        async move { pool.claim(removing).await }
    });
    tokio::task::yield_now().await;
    assert!(
        !waiting.is_finished(),
        "the claim did not wait for the removal"
    );
    pool.set(removing, None);
    assert!(
        !waiting.await.unwrap(),
        "a removed sandbox is no pooled one"
    );
}

#[test]
fn a_sandbox_drawn_long_ago_is_too_old() {
    assert!(!too_old(SandboxId::new()));
    let then = uuid::Timestamp::from_unix(uuid::NoContext, 1_000, 0);
    assert!(too_old(SandboxId(uuid::Uuid::new_v7(then))));
}
