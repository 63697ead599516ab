//! The configuration reference (`deploy/CONFIG.md`) cannot drift from the binary.

use std::collections::BTreeSet;
use std::path::Path;

use crate::kit;

/// Variables read by code that is no configuration: build scripts, the runtime's own pass-
/// through, and the crash and failure points compiled into test builds only.
const NOT_CONFIGURATION: &[&str] = &[
    "OUT_DIR",
    "CC",
    "PATH",
    "LD_PRELOAD",
    "BERTH_HOSTD_CRASH_AT",
    "BERTH_HOSTD_FAIL_AT",
];

#[test]
fn the_configuration_reference_is_what_the_binary_renders() {
    let rendered = kit::rendered_reference();
    let path = kit::repo().join("deploy/CONFIG.md");
    if std::env::var_os("BERTH_BLESS").is_some() {
        std::fs::write(&path, &rendered).expect("write deploy/CONFIG.md");
    }
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != rendered {
        let first = checked_in
            .lines()
            .zip(rendered.lines())
            .position(|(a, b)| a != b)
            .unwrap_or_else(|| checked_in.lines().count().min(rendered.lines().count()));
        panic!(
            "deploy/CONFIG.md is stale (first difference at line {}: {:?} vs the binary's \
             {:?}); regenerate it: `berth docs config > deploy/CONFIG.md`, or run this test \
             with BERTH_BLESS=1",
            first + 1,
            checked_in.lines().nth(first),
            rendered.lines().nth(first)
        );
    }
    // Every component and every flag group is there.
    for section in [
        "`berth api`",
        "`berth hostd`",
        "`berth scheduler`",
        "`berth reconciler`",
    ] {
        assert!(rendered.contains(section), "{section} missing");
    }
    for variable in [
        "DATABASE_URL",
        "NATS_URL",
        "BERTH_NATS_CREDS",
        "BERTH_PREVIEW_SECRET",
    ] {
        assert!(
            rendered.contains(&format!("`{variable}`")),
            "{variable} missing"
        );
    }
}

#[test]
fn every_variable_the_sources_read_is_in_the_reference() {
    let documented = kit::documented_variables(&kit::rendered_reference());
    let mut read = BTreeSet::new();
    for krate in [
        "src",
        "api/src",
        "hostd/src",
        "reconciler/src",
        "scheduler/src",
        "schemas/src",
        "store/src",
        "storage/src",
    ] {
        collect_reads(&kit::repo().join(krate), &mut read);
    }
    assert!(
        read.contains("BERTH_OBJECT_STORE") && read.contains("BERTH_API_KEY"),
        "the scan found too little: {read:?}"
    );
    let missing: Vec<_> = read
        .iter()
        .filter(|v| !documented.contains(*v) && !NOT_CONFIGURATION.contains(&v.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "read by the code but not in deploy/CONFIG.md: {missing:?} (a flag with `env = …`, \
         or a row of OUTSIDE_FLAGS in src/config_doc.rs)"
    );
}

/// The names in `std::env::var("…")`, `var_os("…")`, `env = "…"` and `const …_ENV: &str =
/// "…"` below `dir`.
fn collect_reads(dir: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).expect("read source dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            collect_reads(&path, out);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let source = std::fs::read_to_string(&path).expect("read source");
        for marker in [
            "env::var(\"",
            "env::var_os(\"",
            "env = \"",
            "_ENV: &str = \"",
        ] {
            for piece in source.split(marker).skip(1) {
                let name = piece.split('"').next().unwrap_or_default();
                if kit::is_variable(name) {
                    out.insert(name.to_owned());
                }
            }
        }
    }
}
