//! Tenants, their API keys and limits, and who owns which template.
//!
//! A key is shown once, when it is made; the store keeps only its SHA-256
//! (keys are 256 random bits, so a fast hash is enough). Revoking a key takes
//! effect on the next request: every request looks its key up here.

use rusqlite::{params, OptionalExtension};

use crate::{SqliteStore, StoreError};

/// An API key as `space keys ls` shows it (never the key itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiKey {
    pub id: String,
    pub tenant: String,
    pub name: String,
    pub created_at: String,
    pub revoked_at: Option<String>,
}

/// Per-tenant limits; `None` means the server's default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantLimits {
    pub max_sandboxes: Option<u64>,
    pub max_running_commands: Option<u64>,
    pub creates_per_minute: Option<u64>,
}

impl SqliteStore {
    pub fn insert_api_key(&self, key: &ApiKey, hash: &str) -> Result<(), StoreError> {
        self.conn().execute(
            "INSERT INTO api_keys (id, tenant, hash, name, created_at) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![key.id, key.tenant, hash, key.name, key.created_at],
        )?;
        Ok(())
    }

    /// Stores a sandbox's access token (its hash), keeping its `keep` newest.
    pub fn insert_access_token(
        &self,
        hash: &str,
        sandbox_id: &str,
        tenant: &str,
        keep: usize,
    ) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        tx.execute(
            "INSERT INTO access_tokens (hash, sandbox_id, tenant, created_at) VALUES (?1, ?2, ?3, ?4)",
            params![hash, sandbox_id, tenant, space_core::now_rfc3339()],
        )?;
        tx.execute(
            "DELETE FROM access_tokens WHERE sandbox_id = ?1 AND hash NOT IN \
             (SELECT hash FROM access_tokens WHERE sandbox_id = ?1 \
              ORDER BY created_at DESC, rowid DESC LIMIT ?2)",
            params![sandbox_id, keep as i64],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// The sandbox and tenant of the access token with this hash.
    pub fn access_token(&self, hash: &str) -> Result<Option<(String, String)>, StoreError> {
        Ok(self
            .conn()
            .query_row(
                "SELECT sandbox_id, tenant FROM access_tokens WHERE hash = ?1",
                [hash],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
    }

    /// The tenant of the live (not revoked) key with this hash.
    pub fn tenant_for_key_hash(&self, hash: &str) -> Result<Option<String>, StoreError> {
        Ok(self.key_for_hash(hash)?.map(|(_, tenant)| tenant))
    }

    /// The id and tenant of the live (not revoked) key with this hash.
    pub fn key_for_hash(&self, hash: &str) -> Result<Option<(String, String)>, StoreError> {
        Ok(self
            .conn()
            .prepare_cached(
                "SELECT id, tenant FROM api_keys WHERE hash = ?1 AND revoked_at IS NULL",
            )?
            .query_row([hash], |r| Ok((r.get(0)?, r.get(1)?)))
            .optional()?)
    }

    /// Ids of every revoked key (`space keys revoke` writes the database directly, so a
    /// running server learns of revocations by reading them).
    pub fn revoked_key_ids(&self) -> Result<Vec<String>, StoreError> {
        let conn = self.conn();
        let mut stmt =
            conn.prepare_cached("SELECT id FROM api_keys WHERE revoked_at IS NOT NULL")?;
        let ids = stmt
            .query_map([], |r| r.get(0))?
            .collect::<Result<Vec<String>, _>>()?;
        Ok(ids)
    }

    /// Every key, oldest first; of one tenant when `tenant` is set.
    pub fn list_api_keys(&self, tenant: Option<&str>) -> Result<Vec<ApiKey>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT id, tenant, name, created_at, revoked_at FROM api_keys
             WHERE ?1 IS NULL OR tenant = ?1 ORDER BY created_at, rowid",
        )?;
        let keys = stmt
            .query_map([tenant], |r| {
                Ok(ApiKey {
                    id: r.get(0)?,
                    tenant: r.get(1)?,
                    name: r.get(2)?,
                    created_at: r.get(3)?,
                    revoked_at: r.get(4)?,
                })
            })?
            .collect::<Result<Vec<_>, _>>()?;
        Ok(keys)
    }

    /// Revokes a key; `false` when there is no live key with that id.
    pub fn revoke_api_key(&self, id: &str, now: &str) -> Result<bool, StoreError> {
        let n = self.conn().execute(
            "UPDATE api_keys SET revoked_at = ?2 WHERE id = ?1 AND revoked_at IS NULL",
            params![id, now],
        )?;
        Ok(n == 1)
    }

    pub fn tenant_limits(&self, tenant: &str) -> Result<TenantLimits, StoreError> {
        let row = self
            .conn()
            .query_row(
                "SELECT max_sandboxes, max_running_commands, creates_per_minute
                 FROM tenants WHERE name = ?1",
                [tenant],
                |r| {
                    Ok(TenantLimits {
                        max_sandboxes: r.get::<_, Option<i64>>(0)?.map(|v| v as u64),
                        max_running_commands: r.get::<_, Option<i64>>(1)?.map(|v| v as u64),
                        creates_per_minute: r.get::<_, Option<i64>>(2)?.map(|v| v as u64),
                    })
                },
            )
            .optional()?;
        Ok(row.unwrap_or_default())
    }

    pub fn set_tenant_limits(&self, tenant: &str, l: &TenantLimits) -> Result<(), StoreError> {
        let v = |x: Option<u64>| x.map(|v| v.min(i64::MAX as u64) as i64);
        self.conn().execute(
            "INSERT INTO tenants (name, max_sandboxes, max_running_commands, creates_per_minute)
             VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT(name) DO UPDATE SET max_sandboxes = ?2, max_running_commands = ?3,
                 creates_per_minute = ?4",
            params![
                tenant,
                v(l.max_sandboxes),
                v(l.max_running_commands),
                v(l.creates_per_minute)
            ],
        )?;
        Ok(())
    }

    /// The tenant that built the template `name` (`None`: built-in, or built
    /// before tenants existed).
    pub fn template_owner(&self, name: &str) -> Result<Option<String>, StoreError> {
        Ok(self
            .conn()
            .query_row(
                "SELECT tenant FROM template_owners WHERE name = ?1",
                [name],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// Claims `name` for `tenant`; `false` when another tenant owns it.
    pub fn claim_template(&self, name: &str, tenant: &str) -> Result<bool, StoreError> {
        let conn = self.conn();
        conn.execute(
            "INSERT INTO template_owners (name, tenant) VALUES (?1, ?2) ON CONFLICT(name) DO NOTHING",
            params![name, tenant],
        )?;
        let owner: String = conn.query_row(
            "SELECT tenant FROM template_owners WHERE name = ?1",
            [name],
            |r| r.get(0),
        )?;
        Ok(owner == tenant)
    }

    pub fn release_template(&self, name: &str) -> Result<(), StoreError> {
        self.conn()
            .execute("DELETE FROM template_owners WHERE name = ?1", [name])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_found_by_hash_until_revoked() {
        let s = SqliteStore::open_in_memory().unwrap();
        let k = ApiKey {
            id: "key_1".into(),
            tenant: "acme".into(),
            name: "ci".into(),
            created_at: "2026-01-01T00:00:00Z".into(),
            revoked_at: None,
        };
        s.insert_api_key(&k, "h1").unwrap();
        assert_eq!(
            s.tenant_for_key_hash("h1").unwrap().as_deref(),
            Some("acme")
        );
        assert_eq!(s.tenant_for_key_hash("h2").unwrap(), None);
        assert!(s.revoke_api_key("key_1", "2026-01-02T00:00:00Z").unwrap());
        assert!(!s.revoke_api_key("key_1", "2026-01-02T00:00:00Z").unwrap());
        assert_eq!(s.tenant_for_key_hash("h1").unwrap(), None);
        let all = s.list_api_keys(None).unwrap();
        assert_eq!(all.len(), 1);
        assert!(all[0].revoked_at.is_some());
        assert!(s.list_api_keys(Some("other")).unwrap().is_empty());
    }

    #[test]
    fn limits_and_template_owners() {
        let s = SqliteStore::open_in_memory().unwrap();
        assert_eq!(s.tenant_limits("a").unwrap(), TenantLimits::default());
        let l = TenantLimits {
            max_sandboxes: Some(3),
            max_running_commands: None,
            creates_per_minute: Some(10),
        };
        s.set_tenant_limits("a", &l).unwrap();
        assert_eq!(s.tenant_limits("a").unwrap(), l);
        assert!(s.claim_template("t", "a").unwrap());
        assert!(s.claim_template("t", "a").unwrap());
        assert!(!s.claim_template("t", "b").unwrap());
        assert_eq!(s.template_owner("t").unwrap().as_deref(), Some("a"));
        s.release_template("t").unwrap();
        assert_eq!(s.template_owner("t").unwrap(), None);
        assert!(s.claim_template("t", "b").unwrap());
    }
}
