//! The golden bytes of every wire message and the envelope's version checks.

use super::*;
use uuid::Uuid;

fn uuid(n: u8) -> Uuid {
    Uuid::from_bytes([n; 16])
}

fn sample_command() -> Command {
    Command {
        id: CommandId(uuid(1)),
        sandbox_id: SandboxId(uuid(2)),
        generation: Generation(3),
        kind: CommandKind::Start,
        spec: Some(SandboxSpec {
            org_id: OrgId(uuid(4)),
            template: "base".into(),
            resources: Resources {
                vcpus: 2,
                memory_mib: 512,
            },
            runtime: Runtime::Runsc,
            disk_mib: 1024,
            network: crate::network::Network {
                egress: crate::network::Egress::Allow(vec!["10.1.0.0/16".parse().unwrap()]),
            },
            env: vec![("A".into(), "1".into())],
            entrypoint: vec!["tail".into()],
            image: Some("r/a@x".into()),
        }),
        snapshot: None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// postcard encodes a Uuid (serde, non-human-readable) as a length-prefixed byte string.
const U1: &str = "1001010101010101010101010101010101";
const U2: &str = "1002020202020202020202020202020202";

#[test]
fn command_golden_bytes_v18() {
    let bytes = encode(&sample_command());
    // version 17, ids, generation 3, kind Start, Some(spec { org, "base", 2 vCPUs, 512 MiB,
    // runsc, 1024 MiB of disk, network { egress: Allow([10.1.0.0/16]) }, env [("A", "1")],
    // entrypoint ["tail"] }), snapshot None: the allow-list is variant 2, one network, its four octets and its
    // prefix length; then one env pair and one entrypoint word, each length-prefixed;
    // Some(image "r/a@x"); then the snapshot order, None
    let expected = format!(
        "12{U1}{U2}060101{org}046261736502800401800802010a01000010\
         0101410131\
         01047461696c\
         0105722f614078\
         00",
        org = "1004040404040404040404040404040404"
    );
    assert_eq!(hex(&bytes), expected);
    assert_eq!(decode::<Command>(&bytes).unwrap(), sample_command());
}

#[test]
fn a_snapshot_command_is_the_fifth_kind_with_its_order_and_its_result_the_sixth_outcome() {
    let command = Command {
        kind: CommandKind::Snapshot,
        spec: None,
        snapshot: Some(SnapshotOrder {
            snapshot_id: SnapshotId(uuid(6)),
            parent: Some(SnapshotId(uuid(7))),
            disk_only: false,
        }),
        ..sample_command()
    };
    let bytes = encode(&command);
    // version 17, ids, generation 3, kind Snapshot (4), no spec, Some(order { id, Some(parent), disk_only false })
    let expected = format!(
        "12{U1}{U2}0604000110{u6}0110{u7}00",
        u6 = "06".repeat(16),
        u7 = "07".repeat(16)
    );
    assert_eq!(hex(&bytes), expected);
    assert_eq!(decode::<Command>(&bytes).unwrap(), command);
    // A backup's order: disk_only is the order's last byte.
    let backup = Command {
        snapshot: command.snapshot.map(|o| SnapshotOrder {
            disk_only: true,
            ..o
        }),
        ..command.clone()
    };
    let bytes = encode(&backup);
    assert_eq!(
        hex(&bytes),
        expected[..expected.len() - 2].to_owned() + "01"
    );
    assert_eq!(decode::<Command>(&bytes).unwrap(), backup);

    let result = CommandResult {
        command_id: CommandId(uuid(1)),
        sandbox_id: SandboxId(uuid(2)),
        host_id: HostId(uuid(5)),
        generation: Generation(3),
        kind: CommandKind::Snapshot,
        outcome: ResultOutcome::Snapshotted(SnapshotStored {
            memory: true,
            logical_bytes: 1,
            stored_bytes: 2,
            new_bytes: 3,
            paused_ms: 4,
            chunks: vec![("ab".into(), 5)],
        }),
        heartbeat_seq: 0,
        apply_ms: 0,
    };
    let bytes = encode(&result);
    // ... kind Snapshot (4), outcome variant 5, memory, sizes, paused 4, one chunk ("ab", 5),
    // heartbeat_seq 0, apply_ms 0
    let expected = format!(
        "12{U1}{U2}{U5}060405010102030401026162050000",
        U5 = "1005050505050505050505050505050505",
    );
    assert_eq!(hex(&bytes), expected);
    assert_eq!(decode::<CommandResult>(&bytes).unwrap(), result);
    assert_eq!(result.outcome.fault(), None);
}

#[test]
fn restore_and_clone_are_the_sixth_and_seventh_kinds_and_name_their_snapshot() {
    for (kind, index) in [(CommandKind::Restore, "05"), (CommandKind::Clone, "06")] {
        let command = Command {
            kind,
            spec: None,
            snapshot: Some(SnapshotOrder {
                snapshot_id: SnapshotId(uuid(6)),
                parent: None,
                disk_only: false,
            }),
            ..sample_command()
        };
        let bytes = encode(&command);
        // version 17, ids, generation 3, kind 5 or 6, no spec, Some(order { id, None, disk_only false })
        let expected = format!("12{U1}{U2}06{index}000110{u6}0000", u6 = "06".repeat(16));
        assert_eq!(hex(&bytes), expected, "{kind}");
        assert_eq!(decode::<Command>(&bytes).unwrap(), command);
    }
}

#[test]
fn migrate_is_the_tenth_kind_and_names_its_stop_snapshot() {
    let command = Command {
        kind: CommandKind::Migrate,
        spec: None,
        snapshot: Some(SnapshotOrder {
            snapshot_id: SnapshotId(uuid(6)),
            parent: None,
            disk_only: false,
        }),
        ..sample_command()
    };
    let bytes = encode(&command);
    // version 17, ids, generation 3, kind 9, no spec, Some(order { id, None, disk_only false })
    let expected = format!("12{U1}{U2}0609000110{u6}0000", u6 = "06".repeat(16));
    assert_eq!(hex(&bytes), expected);
    assert_eq!(decode::<Command>(&bytes).unwrap(), command);
}

#[test]
fn archive_and_unarchive_are_the_eighth_and_ninth_kinds_and_durable_the_seventh_outcome() {
    for (kind, index) in [(CommandKind::Archive, "07"), (CommandKind::Unarchive, "08")] {
        let command = Command {
            kind,
            spec: None,
            snapshot: Some(SnapshotOrder {
                snapshot_id: SnapshotId(uuid(6)),
                parent: None,
                disk_only: false,
            }),
            ..sample_command()
        };
        let bytes = encode(&command);
        // version 17, ids, generation 3, kind 7 or 8, no spec, Some(order { id, None, disk_only false })
        let expected = format!("12{U1}{U2}06{index}000110{u6}0000", u6 = "06".repeat(16));
        assert_eq!(hex(&bytes), expected, "{kind}");
        assert_eq!(decode::<Command>(&bytes).unwrap(), command);
    }
    let result = CommandResult {
        command_id: CommandId(uuid(1)),
        sandbox_id: SandboxId(uuid(2)),
        host_id: HostId(uuid(5)),
        generation: Generation(3),
        kind: CommandKind::Stop,
        outcome: ResultOutcome::Durable(StopDurable {
            snapshot_id: SnapshotId(uuid(6)),
            memory: false,
            stored_bytes: 2,
            chunks: vec![("ab".into(), 5)],
        }),
        heartbeat_seq: 0,
        apply_ms: 0,
    };
    let bytes = encode(&result);
    // ... kind Stop (2), outcome variant 6, snapshot id, memory false, stored 2, one chunk
    // ("ab", 5), heartbeat_seq 0, apply_ms 0
    let expected = format!(
        "12{U1}{U2}{U5}06020610{u6}0002010261620500 00",
        U5 = "1005050505050505050505050505050505",
        u6 = "06".repeat(16)
    )
    .replace(' ', "");
    assert_eq!(hex(&bytes), expected);
    assert_eq!(decode::<CommandResult>(&bytes).unwrap(), result);
    assert_eq!(result.outcome.fault(), None);
}

#[test]
fn a_version_7_command_is_refused() {
    // The version-7 bytes of the sample command (no snapshot order).
    let v7 = format!(
        "07{U1}{U2}060101{org}046261736502800401800802010a01000010",
        org = "1004040404040404040404040404040404"
    );
    let bytes: Vec<u8> = (0..v7.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&v7[i..i + 2], 16).unwrap())
        .collect();
    assert!(matches!(
        decode::<Command>(&bytes),
        Err(WireError::UnsupportedVersion { found: 7 })
    ));
}

#[test]
fn a_version_2_command_is_refused() {
    // The version-2 bytes of a command (a spec without its disk limit and network policy).
    let v2 = format!(
        "02{U1}{U2}060101{org}046261736502800401",
        org = "1004040404040404040404040404040404"
    );
    let bytes: Vec<u8> = (0..v2.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&v2[i..i + 2], 16).unwrap())
        .collect();
    assert!(matches!(
        decode::<Command>(&bytes),
        Err(WireError::UnsupportedVersion { found: 2 })
    ));
}

#[test]
fn a_version_1_command_is_refused() {
    // The version-1 bytes of the same command (no runtime, a spec that was not optional).
    let v1 = format!(
        "01{U1}{U2}0601{org}0462617365028004",
        org = "1004040404040404040404040404040404"
    );
    let bytes: Vec<u8> = (0..v1.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&v1[i..i + 2], 16).unwrap())
        .collect();
    assert!(matches!(
        decode::<Command>(&bytes),
        Err(WireError::UnsupportedVersion { found: 1 })
    ));
}

#[test]
fn result_golden_bytes_v18() {
    let result = CommandResult {
        command_id: CommandId(uuid(1)),
        sandbox_id: SandboxId(uuid(2)),
        host_id: HostId(uuid(5)),
        generation: Generation(3),
        kind: CommandKind::Stop,
        outcome: ResultOutcome::Succeeded {
            address: Some("10.1.0.2".into()),
            last_stop: Some(StopMode::Disk),
        },
        heartbeat_seq: 300,
        apply_ms: 1500,
    };
    let bytes = encode(&result);
    // ... Succeeded { Some(address), Some(Disk) }, then heartbeat_seq 300 and apply_ms 1500
    // as varints
    let expected = format!(
        "12{U1}{U2}{U5}0602000108{ip}0101ac02dc0b",
        U5 = "1005050505050505050505050505050505",
        ip = hex(b"10.1.0.2")
    );
    assert_eq!(hex(&bytes), expected);
    assert_eq!(decode::<CommandResult>(&bytes).unwrap(), result);
}

#[test]
fn a_rejected_result_is_the_fourth_outcome_variant() {
    let result = CommandResult {
        command_id: CommandId(uuid(1)),
        sandbox_id: SandboxId(uuid(2)),
        host_id: HostId(uuid(5)),
        generation: Generation(1),
        kind: CommandKind::Create,
        outcome: ResultOutcome::Rejected {
            reason: "no".into(),
        },
        heartbeat_seq: 0,
        apply_ms: 0,
    };
    let bytes = encode(&result);
    // version 17, ids, generation 1 (zigzag: 02), kind Create (0), outcome variant 3, "no", heartbeat_seq 0, apply_ms 0
    let expected = format!(
        "12{U1}{U2}{U5}020003026e6f0000",
        U5 = "1005050505050505050505050505050505",
    );
    assert_eq!(hex(&bytes), expected);
    assert_eq!(decode::<CommandResult>(&bytes).unwrap(), result);
}

#[test]
fn a_stop_that_kept_the_disk_only_is_the_fifth_outcome_variant_with_its_code_and_detail() {
    let result = CommandResult {
        command_id: CommandId(uuid(1)),
        sandbox_id: SandboxId(uuid(2)),
        host_id: HostId(uuid(5)),
        generation: Generation(3),
        kind: CommandKind::Stop,
        outcome: ResultOutcome::StoppedOnDisk {
            fallback: StopFallback::new(StopFallbackCode::CheckpointFailed, "EOF"),
        },
        heartbeat_seq: 0,
        apply_ms: 0,
    };
    let bytes = encode(&result);
    // version 17, ids, generation 3, kind Stop (2), outcome variant 4, code 0, "EOF",
    // heartbeat_seq 0, apply_ms 0
    let expected = format!(
        "12{U1}{U2}{U5}0602040003{eof}0000",
        U5 = "1005050505050505050505050505050505",
        eof = hex(b"EOF")
    );
    assert_eq!(hex(&bytes), expected);
    assert_eq!(decode::<CommandResult>(&bytes).unwrap(), result);
    assert_eq!(result.outcome.fault(), None, "a fallback is no failure");
}

#[test]
fn a_version_7_result_is_refused() {
    // The version-7 bytes of a rejected create (version 8 added `apply_ms`).
    let v7 = format!(
        "07{U1}{U2}{U5}020003026e6f00",
        U5 = "1005050505050505050505050505050505",
    );
    let bytes: Vec<u8> = (0..v7.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&v7[i..i + 2], 16).unwrap())
        .collect();
    assert!(matches!(
        decode::<CommandResult>(&bytes),
        Err(WireError::UnsupportedVersion { found: 7 })
    ));
}

#[test]
fn a_stop_fallback_keeps_a_short_error_whole_on_one_line() {
    let fallback = StopFallback::new(
        StopFallbackCode::CheckpointFailed,
        "runsc checkpoint: exit status 128\n  Checkpoint failed: EOF\n",
    );
    assert_eq!(
        fallback.detail,
        "runsc checkpoint: exit status 128 Checkpoint failed: EOF"
    );
    assert_eq!(fallback.code.as_str(), "checkpoint_failed");
}

#[test]
fn a_stop_fallback_cuts_a_long_error_to_its_bound_at_a_character() {
    let long = "é".repeat(STOP_FALLBACK_DETAIL_MAX_CHARS * 3);
    let fallback = StopFallback::new(StopFallbackCode::CheckpointFailed, &long);
    assert_eq!(
        fallback.detail.chars().count(),
        STOP_FALLBACK_DETAIL_MAX_CHARS
    );
    assert!(fallback.detail.ends_with('…'));
    assert!(fallback.detail.starts_with("éé"));
    let exact = "x".repeat(STOP_FALLBACK_DETAIL_MAX_CHARS);
    assert_eq!(
        StopFallback::new(StopFallbackCode::CheckpointFailed, &exact).detail,
        exact,
        "an error exactly at the bound is kept whole"
    );
}

#[test]
fn every_stop_fallback_code_reads_back_from_its_spelling() {
    for code in StopFallbackCode::ALL {
        assert_eq!(code.as_str().parse::<StopFallbackCode>().unwrap(), code);
    }
    assert!("oom".parse::<StopFallbackCode>().is_err());
}

#[test]
fn heartbeat_golden_bytes_v18() {
    let hb = Heartbeat {
        host_id: HostId(uuid(5)),
        name: "h".into(),
        seq: 300,
        capacity: Resources {
            vcpus: 8,
            memory_mib: 1024,
        },
        used: Resources::default(),
        runtimes: vec![RuntimeInfo {
            name: "runc".into(),
            memory_snapshot: false,
        }],
        inventory: vec![InventoryItem {
            sandbox_id: SandboxId(uuid(2)),
            generation: Generation(1),
            status: GuestStatus::Unhealthy,
        }],
        forwarder: Some("h:1".into()),
        sent_at_ms: 1000,
        warm: vec![WarmSlot {
            sandbox_id: SandboxId(uuid(3)),
            template: "ab".into(),
            runtime: Runtime::Runsc,
            resources: Resources {
                vcpus: 1,
                memory_mib: 2,
            },
            disk_mib: 3,
            image: None,
        }],
    };
    let bytes = encode(&hb);
    // ... the inventory, the forwarder (Some "h:1"), sent_at_ms 1000 as a varint, then one
    // warm slot: its id, template, runtime (runsc = 1), limits, disk and no image
    let expected = format!(
        "12{U5}0168ac0208800800000104{runc}0001{U2}020101{fwd}e807\
         01{U3}02{ab}0101020300",
        U5 = "1005050505050505050505050505050505",
        U3 = "1003030303030303030303030303030303",
        runc = hex(b"runc"),
        ab = hex(b"ab"),
        fwd = "03683a31"
    );
    assert_eq!(hex(&bytes), expected);
    assert_eq!(decode::<Heartbeat>(&bytes).unwrap(), hb);
}

#[test]
fn a_version_3_heartbeat_is_refused() {
    // The version-3 bytes of a heartbeat (no send time).
    let v3 = format!(
        "03{U5}0168ac0208800800000104{runc}0001{U2}0201",
        U5 = "1005050505050505050505050505050505",
        runc = hex(b"runc")
    );
    let bytes: Vec<u8> = (0..v3.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&v3[i..i + 2], 16).unwrap())
        .collect();
    assert!(matches!(
        decode::<Heartbeat>(&bytes),
        Err(WireError::UnsupportedVersion { found: 3 })
    ));
}

/// The plain exec of `{p}.exec.<host_id>`, retired: nothing serves or sends it any more
/// (the agent request carries exec). Kept, frozen, so its bytes stay pinned.
mod legacy {
    use serde::{Deserialize, Serialize};

    use crate::ids::SandboxId;

    /// An exec request, sent by NATS request/reply on `{p}.exec.<host_id>`.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub struct ExecRequest {
        pub sandbox_id: SandboxId,
        /// argv; `argv[0]` is looked up on the guest's `PATH`.
        pub argv: Vec<String>,
        /// Kill the process after this many milliseconds.
        pub timeout_ms: u64,
    }

    /// Why an exec did not run to completion.
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub enum ExecError {
        /// The host has no such sandbox.
        NotFound,
        /// The sandbox exists but does not run.
        NotRunning,
        /// The agent could not be reached or the process could not be spawned.
        Agent(String),
    }

    /// The reply to an [`ExecRequest`].
    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    pub enum ExecReply {
        /// The process ended (or was killed at the timeout, `timed_out`). `exit_code` is the exit
        /// status, or 128 + signal number when killed by a signal.
        Finished {
            exit_code: i32,
            stdout: Vec<u8>,
            stderr: Vec<u8>,
            timed_out: bool,
        },
        Failed(ExecError),
    }
}

#[test]
fn exec_golden_bytes_v1() {
    use legacy::{ExecReply, ExecRequest};
    let req = ExecRequest {
        sandbox_id: SandboxId(uuid(2)),
        argv: vec!["echo".into(), "hi".into()],
        timeout_ms: 1000,
    };
    // Frozen as version-1 bytes: the envelope's version byte, then the body.
    let bytes = [&[1u8][..], &postcard::to_stdvec(&req).unwrap()].concat();
    assert_eq!(
        hex(&bytes),
        format!(
            "01{U2}0204{echo}02{hi}e807",
            echo = hex(b"echo"),
            hi = hex(b"hi")
        )
    );
    let reply = ExecReply::Finished {
        exit_code: -1,
        stdout: b"a".to_vec(),
        stderr: vec![],
        timed_out: true,
    };
    // i32 is zig-zag encoded: -1 → 1.
    let bytes = [&[1u8][..], &postcard::to_stdvec(&reply).unwrap()].concat();
    assert_eq!(hex(&bytes), "010001016100".to_owned() + "01");
    assert_eq!(
        postcard::from_bytes::<ExecReply>(&bytes[1..]).unwrap(),
        reply
    );
}

#[test]
fn agent_golden_bytes_v18() {
    let req = AgentRequest {
        sandbox_id: SandboxId(uuid(2)),
        op: AgentOp::Exec(ExecSpec {
            argv: vec!["cat".into()],
            env: vec![("A".into(), "b".into())],
            cwd: Some("/".into()),
            stdin: b"x".to_vec(),
            timeout_ms: 5,
        }),
    };
    let bytes = encode(&req);
    assert_eq!(
        hex(&bytes),
        format!(
            "12{U2}000103{cat}0101{a}01{b}01012f017805",
            cat = hex(b"cat"),
            a = "41",
            b = "62"
        )
    );
    assert_eq!(decode::<AgentRequest>(&bytes).unwrap(), req);
    let read = AgentRequest {
        sandbox_id: SandboxId(uuid(2)),
        op: AgentOp::Read {
            path: "/f".into(),
            offset: 1,
            len: 2,
        },
    };
    assert_eq!(hex(&encode(&read)), format!("12{U2}02022f660102"));
    let reply = AgentReply::Exec {
        exit_code: 137,
        stdout: vec![],
        stderr: vec![],
        timed_out: false,
        oom_killed: true,
    };
    // 137 zig-zags to 274 = varint 92 02.
    assert_eq!(hex(&encode(&reply)), "12009202000000".to_owned() + "01");
    let output = AgentReply::Output {
        fd: 2,
        data: b"e".to_vec(),
    };
    assert_eq!(hex(&encode(&output)), "1207020165");
    let stream = AgentOp::ExecStream(ExecSpec {
        argv: vec![],
        env: vec![],
        cwd: None,
        stdin: vec![],
        timeout_ms: 1,
    });
    assert_eq!(hex(&encode(&stream)), "12060000000001");
    let windowed = AgentOp::ExecStreamWindowed {
        spec: ExecSpec {
            argv: vec![],
            env: vec![],
            cwd: None,
            stdin: vec![],
            timeout_ms: 1,
        },
        window: 16,
    };
    assert_eq!(hex(&encode(&windowed)), "1207000000000110");
    let credit = AgentOp::StreamCredit {
        reply_to: "r".into(),
        chunks: 8,
    };
    assert_eq!(hex(&encode(&credit)), "12080172".to_owned() + "08");
    let cancel = AgentOp::StreamCancel {
        reply_to: "r".into(),
    };
    assert_eq!(hex(&encode(&cancel)), "12090172");
    let remove = AgentOp::Remove { path: "/f".into() };
    assert_eq!(hex(&encode(&remove)), "120a022f66");
    let not_regular = AgentReply::Failed(AgentFailure::NotRegularFile);
    assert_eq!(hex(&encode(&not_regular)), "120605");
    let failed = AgentReply::Failed(AgentFailure::TooLarge { limit: 300 });
    assert_eq!(hex(&encode(&failed)), "120603ac02");
    assert_eq!(decode::<AgentReply>(&encode(&failed)).unwrap(), failed);
    // Version 8: a session on a pseudo-terminal and its input.
    let tty = AgentOp::Tty {
        spec: ExecSpec {
            argv: vec![],
            env: vec![],
            cwd: None,
            stdin: vec![],
            timeout_ms: 1,
        },
        size: TtySize { rows: 24, cols: 80 },
        window: 16,
    };
    assert_eq!(hex(&encode(&tty)), "120b00000000011850".to_owned() + "10");
    let input = AgentOp::TtyInput {
        reply_to: "r".into(),
        input: TtyInput::Data(b"l".to_vec()),
    };
    assert_eq!(hex(&encode(&input)), "120c017200016c");
    let resize = AgentOp::TtyInput {
        reply_to: "r".into(),
        input: TtyInput::Resize(TtySize { rows: 1, cols: 2 }),
    };
    assert_eq!(hex(&encode(&resize)), "120c0172010102");
    assert_eq!(decode::<AgentOp>(&encode(&resize)).unwrap(), resize);
}

#[test]
fn an_unknown_version_is_refused_not_misread() {
    let mut bytes = encode(&sample_command());
    bytes[0] = 19;
    assert!(matches!(
        decode::<Command>(&bytes),
        Err(WireError::UnsupportedVersion { found: 19 })
    ));
    assert!(matches!(
        decode::<Command>(&[18, 0xff]),
        Err(WireError::Malformed(_))
    ));
}
