//! Warm pools: what each pool is (its template, runtime, resources, network and size)
//! and the claim that hands one of its sandboxes to a tenant.
//!
//! A pool's sandboxes are ordinary sandbox rows of the reserved tenant the service
//! names; a claim moves one to the claiming tenant in one transaction, with nothing of
//! its time in the pool kept (operations, commands, access tokens).

use rusqlite::{params, OptionalExtension};
use space_api::{Operation, Pool};

use crate::{
    cas_sandbox, insert_op, op_event, sandbox_event, SandboxRecord, SqliteStore, StoreError,
};

impl SqliteStore {
    /// Every pool, oldest first.
    pub fn list_pools(&self) -> Result<Vec<Pool>, StoreError> {
        let conn = self.conn();
        let mut stmt = conn.prepare_cached("SELECT doc FROM pools ORDER BY created_at, rowid")?;
        let docs = stmt
            .query_map([], |r| r.get::<_, String>(0))?
            .collect::<Result<Vec<_>, _>>()?;
        docs.iter()
            .map(|d| serde_json::from_str(d).map_err(StoreError::from))
            .collect()
    }

    /// Stores `pool` (a new one, or the new size of one with its id).
    pub fn put_pool(&self, pool: &Pool) -> Result<(), StoreError> {
        self.conn().execute(
            "INSERT INTO pools (id, created_at, doc) VALUES (?1, ?2, ?3)
             ON CONFLICT(id) DO UPDATE SET doc = ?3",
            params![pool.id, pool.created_at, serde_json::to_string(pool)?],
        )?;
        Ok(())
    }

    /// Removes a pool; `false` when there is none with that id.
    pub fn delete_pool(&self, id: &str) -> Result<bool, StoreError> {
        Ok(self
            .conn()
            .execute("DELETE FROM pools WHERE id = ?1", [id])?
            == 1)
    }

    /// Hands the pooled sandbox `rec` (read at its version, still of tenant `from`) to
    /// `rec.sandbox.tenant`, as `rec` says, with `op` as its create: all in one
    /// transaction, compare-and-swap on the version, or nothing
    /// ([`StoreError::Conflict`]). The operations, commands and access tokens of its
    /// time in the pool are deleted.
    pub fn claim_sandbox(
        &self,
        rec: &mut SandboxRecord,
        from: &str,
        op: &Operation,
    ) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction()?;
        let id = rec.sandbox.id.clone();
        let owner: Option<String> = tx
            .query_row("SELECT tenant FROM sandboxes WHERE id = ?1", [&id], |r| {
                r.get(0)
            })
            .optional()?;
        if owner.as_deref() != Some(from) {
            return Err(StoreError::Conflict {
                what: "sandbox",
                id,
                version: rec.sandbox.version,
            });
        }
        cas_sandbox(&tx, rec)?;
        tx.execute(
            "UPDATE sandboxes SET tenant = ?2, created_at = ?3 WHERE id = ?1",
            params![id, rec.sandbox.tenant, rec.sandbox.created_at],
        )?;
        tx.execute("DELETE FROM commands WHERE sandbox_id = ?1", [&id])?;
        tx.execute("DELETE FROM access_tokens WHERE sandbox_id = ?1", [&id])?;
        tx.execute("DELETE FROM operations WHERE sandbox_id = ?1", [&id])?;
        insert_op(&tx, op)?;
        sandbox_event(&tx, rec)?;
        let event = op_event(&tx, op)?;
        tx.commit()?;
        self.published(Some(event));
        Ok(())
    }
}
