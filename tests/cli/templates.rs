//! `berth template pull` against a real registry on loopback (Debian's `docker-registry`, an
//! image pushed with `skopeo`): the pull waits under its spinner and prints the template's name,
//! state and digest; `template ls` shows its image and state; a sandbox created from it has the
//! image's files; an unknown image and a registry that wants credentials exit 65 with the pull's
//! code; a bad name exits 64.

use serde_json::Value;
use sqlx::PgPool;

use crate::kit::{ok, User};
use crate::support::registry::{push_marked_image, Registry};
use crate::support::{unique, Stack};

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn template_pull_waits_for_the_image_and_a_failed_pull_exits_65_with_its_code(db: PgPool) {
    let registry = Registry::start().await;
    let mark = format!("cli {}", unique());
    let image = push_marked_image(&registry, "cli", &mark);
    let locked = Registry::start_with_auth().await;
    let stack = Stack::start(db, 1).await;
    let user = User::of(&stack);
    // Templates are shared by every org: an operator pulls them, an org's key is refused (77).
    let operator_key = berth_api::auth::create_admin_key(&stack.db).await.unwrap();
    let operator = User::with(&stack.base, Some(&operator_key));
    let name = format!("cli-{}", unique());
    let run = user.run(&["template", "pull", &name, &image]).await;
    assert_eq!(run.code, 77, "{run:?}");

    // The pull waits until the template is ready and prints one line.
    let out = ok(
        &operator,
        &["template", "pull", &name, &image, "--runtime", "runc"],
    )
    .await;
    let words: Vec<&str> = out.split_whitespace().collect();
    assert_eq!(words.len(), 3, "{out}");
    assert_eq!((words[0], words[1]), (name.as_str(), "ready"), "{out}");
    assert!(words[2].starts_with("sha256:"), "{out}");
    // Again, as JSON: idempotent, the API's template with its events.
    let again: Value = serde_json::from_str(
        &ok(
            &operator,
            &[
                "template",
                "pull",
                &name,
                &image,
                "--runtime",
                "runc",
                "--json",
            ],
        )
        .await,
    )
    .expect("JSON");
    assert_eq!(again["state"], "ready", "{again}");
    assert_eq!(again["image_digest"], words[2], "{again}");
    assert_eq!(
        again["events"].as_array().unwrap().last().unwrap()["type"],
        "template.ready"
    );

    // ls shows its state and image, to the operator and to the org; built-in templates have none.
    let by_operator = ok(&operator, &["template", "ls"]).await;
    assert!(
        by_operator.lines().any(|l| l.starts_with(&name)),
        "{by_operator}"
    );
    let table = ok(&user, &["template", "ls"]).await;
    let header = table.lines().next().unwrap();
    assert!(
        header.contains("STATE") && header.contains("IMAGE"),
        "{table}"
    );
    let row = table
        .lines()
        .find(|l| l.starts_with(&name))
        .expect("listed");
    assert!(row.contains(" ready ") && row.contains(&image), "{table}");
    let base = table
        .lines()
        .find(|l| l.starts_with("base "))
        .expect("base");
    let base: Vec<&str> = base.split_whitespace().collect();
    assert_eq!(base[..4], ["base", "runc", "ready", "-"], "{table}");

    // A sandbox of it has the image's files.
    let id = ok(
        &user,
        &["sandbox", "create", "-t", &name, "--memory-mib", "256"],
    )
    .await
    .trim()
    .to_owned();
    let out = ok(
        &user,
        &["sandbox", "exec", &id, "--", "cat", "/etc/berth-mark"],
    )
    .await;
    assert_eq!(out, mark);
    ok(&user, &["sandbox", "rm", &id]).await;

    // Failed pulls: the code and message on stderr, exit 65, the template listed as failed.
    let missing = format!("missing-{}", unique());
    let run = operator
        .run(&[
            "template",
            "pull",
            &missing,
            &registry.reference("nope", "1"),
        ])
        .await;
    assert_eq!(run.code, 65, "{run:?}");
    assert!(
        run.stderr.starts_with("berth: template ") && run.stderr.contains("(unknown_image)"),
        "{run:?}"
    );
    assert_eq!(run.stdout, "", "{run:?}");
    let run = operator
        .run(&[
            "template",
            "pull",
            &format!("locked-{}", unique()),
            &locked.reference("x", "1"),
        ])
        .await;
    assert_eq!(run.code, 65, "{run:?}");
    assert!(run.stderr.contains("(auth_failed)"), "{run:?}");
    let table = ok(&user, &["template", "ls"]).await;
    let row = table
        .lines()
        .find(|l| l.starts_with(&missing))
        .expect("listed");
    assert!(row.contains(" failed "), "{table}");

    // A bad request: 64 and the API's message.
    let run = operator
        .run(&["template", "pull", "Bad Name", &image])
        .await;
    assert_eq!(run.code, 64, "{run:?}");
    assert!(run.stderr.contains("template names are"), "{run:?}");
    stack.teardown().await;
}
