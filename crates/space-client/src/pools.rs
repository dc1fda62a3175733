//! `/v1/pools`: warm pools (the server's own token only).

use reqwest::Method;
use space_api::{Pool, PoolList, PoolSpec};

use crate::{Client, Result};

impl Client {
    /// `GET /v1/pools`: every pool with its ready and booting sandboxes.
    pub async fn pools(&self) -> Result<Vec<Pool>> {
        let list: PoolList = self.get_json(Method::GET, &["v1", "pools"], &[]).await?;
        Ok(list.pools)
    }

    /// `PUT /v1/pools`: creates the pool of `spec`, or sets its size.
    pub async fn set_pool(&self, spec: &PoolSpec) -> Result<Pool> {
        let url = self.url(&["v1", "pools"], &[])?;
        self.send_json(self.req(Method::PUT, url, true).json(spec))
            .await
    }

    /// `DELETE /v1/pools/{id}`: the pool goes, its sandboxes are destroyed.
    pub async fn delete_pool(&self, id: &str) -> Result<()> {
        let url = self.url(&["v1", "pools", id], &[])?;
        self.send_ok(self.req(Method::DELETE, url, true)).await?;
        Ok(())
    }
}
