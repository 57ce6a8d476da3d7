//! Placeholder until the hub resolver lands (branch `text`).
use crate::{Error, Result};
use std::path::PathBuf;
pub struct HubOptions;
impl HubOptions {
    pub fn from_env() -> Self {
        HubOptions
    }
}
pub fn looks_like_repo_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    parts.len() == 2 && parts.iter().all(|p| !p.is_empty() && !p.starts_with('.'))
}
pub fn resolve(repo: &str, _o: &HubOptions) -> Result<PathBuf> {
    Err(Error::Hub { repo: repo.into(), cause: "hub resolution not built yet".into(), hint: "pass a local directory".into() })
}
