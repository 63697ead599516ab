//! `deploy/systemd/`: every unit passes `systemd-analyze verify`, every component has one,
//! and they name only flags and variables the binary knows, secrets never inline.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::kit;
use crate::manifests::SECRET_VARIABLES;

/// Where the units expect the binary.
const INSTALLED: &str = "/usr/local/bin/berth";

/// The most `systemd-analyze security` exposure (0–100, its "OK" band ends at 2.9) a unit of a
/// component that runs no sandboxes may have. hostd has no bound: it runs as root with every
/// capability, and its unit says why.
const STATELESS_EXPOSURE: &str = "20";

fn units() -> Vec<PathBuf> {
    kit::files(&kit::repo().join("deploy/systemd"), ".service")
}

/// Runs `systemd-analyze <args> <units>` on copies of `units` in a temporary directory whose
/// `ExecStart` runs the binary under test (verify insists the command exists): whether it
/// succeeded, and what it said.
fn analyze(args: &[&str], units: &[(String, String)]) -> (bool, String) {
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("berth-units-{}-{seq}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut paths = Vec::new();
    for (name, text) in units {
        let path = dir.join(name);
        let text = text.replace(INSTALLED, &kit::berth().to_string_lossy());
        std::fs::write(&path, text).expect("write unit copy");
        paths.push(path);
    }
    let out = kit::run(Command::new("systemd-analyze").args(args).args(&paths));
    let _ = std::fs::remove_dir_all(&dir);
    let said = format!("{}{}", kit::text(&out.stdout), kit::text(&out.stderr));
    (out.status.success(), said)
}

/// `systemd-analyze verify`: successful and quiet (it only warns about what systemd would
/// ignore), or what it said.
fn verify(units: &[(String, String)]) -> Result<(), String> {
    match analyze(&["verify"], units) {
        (true, said) if said.trim().is_empty() => Ok(()),
        (_, said) => Err(said),
    }
}

fn read(path: &Path) -> (String, String) {
    let name = path
        .file_name()
        .expect("name")
        .to_string_lossy()
        .into_owned();
    (name, std::fs::read_to_string(path).expect("read unit"))
}

#[test]
fn every_systemd_unit_passes_systemd_analyze_verify() {
    let all: Vec<_> = units().iter().map(|p| read(p)).collect();
    if let Err(said) = verify(&all) {
        panic!("systemd-analyze verify deploy/systemd:\n{said}");
    }
    // verify speaks up about what systemd would ignore: a misspelt key, a bad value.
    let hostd = all
        .iter()
        .find(|(n, _)| n == "berth-hostd.service")
        .expect("berth-hostd.service")
        .clone();
    for broken in [
        hostd.1.replace("KillMode=process", "KilMode=process"),
        hostd.1.replace("KillMode=process", "KillMode=proces"),
    ] {
        assert!(
            verify(&[(hostd.0.clone(), broken)]).is_err(),
            "a broken unit passed"
        );
    }
}

#[test]
fn every_component_has_a_unit_naming_only_known_flags_and_variables() {
    let reference = kit::rendered_reference();
    let variables = kit::documented_variables(&reference);
    let flags = kit::documented_flags(&reference);
    let all: Vec<_> = units().iter().map(|p| read(p)).collect();
    for component in [
        "api",
        "scheduler",
        "reconciler",
        "hostd",
        "proxy",
        "migrate",
    ] {
        let name = format!("berth-{component}.service");
        let (_, text) = all
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("{name} missing"));
        let exec = text
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .unwrap_or_else(|| panic!("{name}: no ExecStart"));
        let mut words = exec.split_whitespace();
        assert_eq!(words.next(), Some(INSTALLED), "{name}");
        assert_eq!(
            words.next(),
            Some(component),
            "{name} runs another subcommand"
        );
        for word in words.filter(|w| w.starts_with("--")) {
            assert!(flags.contains(word), "{name}: {word} is no flag of berth");
        }
    }
    for (name, text) in &all {
        for assignment in text.lines().filter_map(|l| l.strip_prefix("Environment=")) {
            let var = assignment.split('=').next().unwrap_or_default();
            assert!(
                variables.contains(var),
                "{name}: {var} is no Berth variable"
            );
            assert!(
                !SECRET_VARIABLES.contains(&var),
                "{name}: {var} inline (use EnvironmentFile= or LoadCredential=)"
            );
        }
    }
}

#[test]
fn the_units_of_components_that_run_no_sandboxes_are_hardened() {
    let all: Vec<_> = units().iter().map(|p| read(p)).collect();
    let threshold = format!("--threshold={STATELESS_EXPOSURE}");
    let args = ["security", "--offline=yes", threshold.as_str()];
    for unit in all.iter().filter(|(n, _)| n != "berth-hostd.service") {
        // One at a time, so the failure names the unit; `security` prints its table either
        // way, and its exit status says whether the exposure was above the threshold.
        let (ok, said) = analyze(&args, std::slice::from_ref(unit));
        assert!(
            ok,
            "{}: exposure above {STATELESS_EXPOSURE}:\n{said}",
            unit.0
        );
    }
    // Without the hardening block, the same unit fails the bound.
    let (name, api) = all
        .iter()
        .find(|(n, _)| n == "berth-api.service")
        .expect("api unit");
    let bare: String = api
        .lines()
        .take_while(|l| !l.starts_with("DynamicUser="))
        .chain(["", "[Install]", "WantedBy=multi-user.target"])
        .collect::<Vec<_>>()
        .join("\n");
    assert!(
        !analyze(&args, &[(name.clone(), bare)]).0,
        "an unhardened unit passed"
    );
}
