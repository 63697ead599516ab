//! Unit tests of the API's request and response models.

use super::*;

fn field_of(e: ApiError) -> Option<String> {
    match e {
        ApiError::InvalidRequest { field, .. } => field,
        other => panic!("expected invalid_request, got {other:?}"),
    }
}

#[test]
fn an_empty_create_gets_the_defaults() {
    let v = CreateSandbox::default()
        .validate(DiskLimits::default())
        .unwrap();
    assert_eq!(v.template, "base");
    assert_eq!(v.disk_mib, DEFAULT_DISK_MIB);
    assert_eq!(
        v.resources,
        Resources {
            vcpus: 1,
            memory_mib: 512
        }
    );
}

#[test]
fn out_of_range_sizes_name_their_field() {
    let zero_cpu = CreateSandbox {
        vcpus: Some(0),
        ..Default::default()
    };
    assert_eq!(
        field_of(zero_cpu.validate(DiskLimits::default()).unwrap_err()).as_deref(),
        Some("vcpus")
    );
    let huge_mem = CreateSandbox {
        memory_mib: Some(1 << 20),
        ..Default::default()
    };
    assert_eq!(
        field_of(huge_mem.validate(DiskLimits::default()).unwrap_err()).as_deref(),
        Some("memory_mib")
    );
}

#[test]
fn a_disk_outside_the_operators_bounds_names_its_field_and_the_bounds() {
    let limits = DiskLimits::new(128, 1024).unwrap();
    let default = CreateSandbox::default().validate(limits).unwrap();
    assert_eq!(default.disk_mib, 128);
    for bad in [0, MIN_DISK_MIB - 1, 1025, u32::MAX] {
        let create = CreateSandbox {
            disk_mib: Some(bad),
            ..Default::default()
        };
        match create.validate(limits).unwrap_err() {
            ApiError::InvalidRequest { field, message } => {
                assert_eq!(field.as_deref(), Some("disk_mib"));
                assert!(message.contains("between 64 and 1024"), "{message}");
            }
            other => panic!("expected invalid_request, got {other:?}"),
        }
    }
    let max = CreateSandbox {
        disk_mib: Some(1024),
        ..Default::default()
    };
    assert_eq!(max.validate(limits).unwrap().disk_mib, 1024);
}

#[test]
fn disk_limits_refuse_a_default_above_the_maximum_or_below_the_minimum() {
    assert!(DiskLimits::new(2048, 1024).is_err());
    assert!(DiskLimits::new(MIN_DISK_MIB - 1, 1024).is_err());
    assert!(DiskLimits::new(MIN_DISK_MIB, MIN_DISK_MIB).is_ok());
}

#[test]
fn a_bad_network_policy_names_the_network_field() {
    let bad = CreateSandbox {
        network: Some(serde_json::json!({"egress": ["10.0.0.0/40"]})),
        ..Default::default()
    };
    assert_eq!(
        field_of(bad.validate(DiskLimits::default()).unwrap_err()).as_deref(),
        Some("network")
    );
    assert_eq!(
        CreateSandbox::default()
            .validate(DiskLimits::default())
            .unwrap()
            .network,
        Network::default()
    );
}

#[test]
fn metadata_values_must_be_strings() {
    let mut m = serde_json::Map::new();
    m.insert("n".into(), serde_json::json!(1));
    let bad = CreateSandbox {
        metadata: Some(m),
        ..Default::default()
    };
    assert_eq!(
        field_of(bad.validate(DiskLimits::default()).unwrap_err()).as_deref(),
        Some("metadata")
    );
}
