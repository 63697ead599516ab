//! The `templates` table: a template imported on the hosts (`berth template import`) is
//! registered here so creates may name it; [`list`] serves `GET /v1/templates`.

use sqlx::{PgPool, Row};

use super::ServiceError;
use crate::model::Template;

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

/// Every registered template, by name.
pub async fn list(db: &PgPool) -> Result<Vec<Template>, ServiceError> {
    let rows = sqlx::query("SELECT name, description, runtime FROM templates ORDER BY name")
        .fetch_all(db)
        .await?;
    Ok(rows
        .iter()
        .map(|r| {
            Ok(Template {
                name: r.try_get("name")?,
                description: r.try_get("description")?,
                runtime: r.try_get("runtime")?,
            })
        })
        .collect::<Result<Vec<_>, sqlx::Error>>()?)
}
