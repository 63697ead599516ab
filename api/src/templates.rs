//! The `templates` table's writes (its listing is `GET /v1/templates` in `sandboxes`): a
//! template imported on the hosts (`berth template import`) is registered here so creates may
//! name it.

use sqlx::PgPool;

/// Registers (or updates) template `name` with `runtime` (`runc`, `runsc`).
///
/// The template's root filesystem must exist on every host that may be chosen for it (hostd
/// finds imported templates in its machine's template cache); placement does not check.
///
/// Errors: [`sqlx::Error`].
pub async fn register(
    db: &PgPool,
    name: &str,
    description: &str,
    runtime: &str,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO templates (name, description, runtime) VALUES ($1, $2, $3)
         ON CONFLICT (name) DO UPDATE SET description = EXCLUDED.description,
                                          runtime = EXCLUDED.runtime",
    )
    .bind(name)
    .bind(description)
    .bind(runtime)
    .execute(db)
    .await?;
    Ok(())
}
