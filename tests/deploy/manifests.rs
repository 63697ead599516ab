//! `deploy/kubernetes/`: schema-valid for the Kubernetes versions Berth supports, naming only
//! flags and variables the binary knows, secrets only through Secret objects; and the NATS
//! chart's values asking for what Berth relies on.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

use crate::kit;

/// The oldest and the newest Kubernetes the manifests are checked against (schemas vendored
/// in the pinned `kubernetes-validate`).
const KUBERNETES_VERSIONS: &[&str] = &["1.30.0", "1.37.0"];

/// Variables whose values are secrets: never a literal in a manifest or a ConfigMap.
pub const SECRET_VARIABLES: &[&str] = &[
    "DATABASE_URL",
    "BERTH_PREVIEW_SECRET",
    "BERTH_FORWARDER_KEY",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
];

fn manifests() -> Vec<PathBuf> {
    kit::files(&kit::repo().join("deploy/kubernetes"), ".yaml")
}

fn validate(files: &[PathBuf], version: &str) -> (bool, String) {
    let out = kit::run(
        Command::new(kit::venv_tool("kubernetes-validate"))
            .args(["--strict", "--quiet", "--kubernetes-version", version])
            .args(files),
    );
    let said = format!("{}{}", kit::text(&out.stdout), kit::text(&out.stderr));
    (out.status.success() && said.trim().is_empty(), said)
}

/// Every document of `files`, as JSON (PyYAML of the validator's venv reads the YAML).
fn documents(files: &[PathBuf]) -> Vec<Value> {
    let out = kit::run(
        Command::new(kit::venv_tool("python3"))
            .args([
                "-c",
                "import sys, json, yaml\n\
                 print(json.dumps([d for f in sys.argv[1:] for d in yaml.safe_load_all(open(f)) if d]))",
            ])
            .args(files),
    );
    assert!(
        out.status.success(),
        "read YAML: {}",
        kit::text(&out.stderr)
    );
    serde_json::from_slice::<Vec<Value>>(&out.stdout).expect("YAML as JSON")
}

#[test]
fn every_kubernetes_manifest_validates_against_the_pinned_schemas() {
    let files = manifests();
    for version in KUBERNETES_VERSIONS {
        let (ok, said) = validate(&files, version);
        assert!(
            ok,
            "deploy/kubernetes against Kubernetes {version}:\n{said}"
        );
    }
    // The validator refuses what a cluster would: a misspelt field, a string for a number.
    let dir = std::env::temp_dir().join(format!("berth-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let hostd = std::fs::read_to_string(kit::repo().join("deploy/kubernetes/60-hostd.yaml"))
        .expect("read hostd.yaml");
    let api = std::fs::read_to_string(kit::repo().join("deploy/kubernetes/20-api.yaml"))
        .expect("read api.yaml");
    for (name, broken) in [
        (
            "misspelt.yaml",
            hostd.replace("privileged: true", "privilegd: true"),
        ),
        (
            "wrong-type.yaml",
            api.replace("replicas: 2", "replicas: two"),
        ),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, broken).expect("write broken copy");
        let (ok, said) = validate(&[path], KUBERNETES_VERSIONS[0]);
        assert!(
            !ok && said.contains("did not validate"),
            "{name} passed: {said}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_manifests_name_only_known_flags_and_variables_and_keep_secrets_in_secrets() {
    let reference = kit::rendered_reference();
    let variables = kit::documented_variables(&reference);
    let flags = kit::documented_flags(&reference);
    let docs = documents(&manifests());
    assert!(
        docs.iter().all(|d| d["kind"] != "Secret"),
        "a Secret object in deploy/kubernetes: secrets are made by the operator"
    );
    let mut containers = 0;
    for doc in &docs {
        if doc["kind"] == "ConfigMap" {
            for key in doc["data"].as_object().expect("ConfigMap data").keys() {
                assert!(
                    variables.contains(key),
                    "ConfigMap key {key} is no Berth variable"
                );
                assert!(
                    !SECRET_VARIABLES.contains(&key.as_str()),
                    "{key} in a ConfigMap"
                );
            }
        }
        let spec = &doc["spec"]["template"]["spec"];
        for list in ["containers", "initContainers"] {
            for container in spec[list].as_array().into_iter().flatten() {
                containers += 1;
                let name = &container["name"];
                for env in container["env"].as_array().into_iter().flatten() {
                    let var = env["name"].as_str().expect("env name");
                    assert!(
                        variables.contains(var),
                        "{name}: {var} is no Berth variable"
                    );
                    if SECRET_VARIABLES.contains(&var) {
                        assert!(
                            env["valueFrom"]["secretKeyRef"].is_object(),
                            "{name}: {var} must come from a Secret"
                        );
                    }
                }
                let words = ["command", "args"]
                    .iter()
                    .flat_map(|k| container[*k].as_array().into_iter().flatten())
                    .filter_map(Value::as_str)
                    .flat_map(str::split_whitespace);
                for word in words.filter(|w| w.starts_with("--")) {
                    assert!(flags.contains(word), "{name}: {word} is no flag of berth");
                }
            }
        }
    }
    assert!(containers >= 6, "found only {containers} containers");
}

#[test]
fn the_nats_values_ask_for_three_jetstream_nodes_on_volumes_with_berths_users() {
    let docs = documents(&[kit::repo().join("deploy/kubernetes/nats/values.yaml")]);
    let values = &docs[0];
    let config = &values["config"];
    assert_eq!(config["cluster"]["enabled"].as_bool(), Some(true));
    assert_eq!(config["cluster"]["replicas"].as_u64(), Some(3));
    assert_eq!(config["jetstream"]["enabled"].as_bool(), Some(true));
    assert_eq!(
        config["jetstream"]["fileStore"]["pvc"]["enabled"].as_bool(),
        Some(true)
    );
    // The include names a file in the directory the container patch mounts (relative to
    // the chart's /etc/nats-config).
    let include = config["merge"]["$include"].as_str().expect("$include");
    let dir = include
        .strip_prefix("../")
        .and_then(|p| p.rsplit_once('/'))
        .map(|(d, _)| format!("/etc/{d}"))
        .expect("an include beside /etc/nats-config");
    let mounts = values["container"]["patch"]
        .as_array()
        .expect("container patch");
    assert!(
        mounts
            .iter()
            .any(|p| p["value"]["mountPath"] == dir.as_str()),
        "nothing mounted at {dir}"
    );
    // Berth's clients are pointed at that release's Service.
    let config_map = documents(&[kit::repo().join("deploy/kubernetes/10-config.yaml")]);
    assert!(config_map
        .iter()
        .all(|d| d["data"]["NATS_URL"] == "nats://nats.nats.svc:4222"));
}
