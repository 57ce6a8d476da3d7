//! Hugging Face Hub repo ids -> a local model directory.
//!
//! Where it sits: first step of loading. A model given as `Org/Name[@revision]` is turned
//! into a directory holding `config.json`, the tokenizer files and the safetensors weights;
//! everything after (config parsing, tokenizer, chat template, weights) reads that
//! directory and never knows where it came from.
//!
//! The directory is a snapshot of the standard Hugging Face cache, shared with Python's
//! `huggingface_hub`:
//!
//! ```text
//! {cache}/models--Org--Name/refs/{revision}          -> commit hash (text)
//! {cache}/models--Org--Name/blobs/{etag}             -> file content
//! {cache}/models--Org--Name/snapshots/{hash}/{file}  -> symlink ../../blobs/{etag}
//! ```
//!
//! `{cache}` is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//! else `~/.cache/huggingface/hub`. A revision may be a branch/tag name (looked up in
//! `refs/`) or a commit hash.
//!
//! When the snapshot is missing (no `config.json`), and unless offline, the files are
//! downloaded with `GET {endpoint}/{repo}/resolve/{revision}/{file}` into that same layout:
//! content in `blobs/` under the server's ETag and a relative symlink in `snapshots/` (as
//! `huggingface_hub` does), so either tool can use what the other downloaded. Where the
//! server sends no ETag, or on platforms without symlinks, the file is stored directly in
//! `snapshots/`. Files are written under a temporary name and renamed when complete;
//! `config.json` is written last, so an interrupted download is resumed (file by file) on
//! the next call rather than taken for a complete snapshot.
//!
//! Downloaded: `config.json` and the weights (`model.safetensors.index.json` plus the
//! shards it lists, or `model.safetensors`) are required; `tokenizer.json`,
//! `tokenizer_config.json`, `generation_config.json` and `chat_template.jinja` are fetched
//! when the repo has them (draft-model repos usually have no tokenizer).

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::{Error, Result};

/// Where and how to resolve repo ids. [`HubOptions::from_env`] reads the usual `HF_*`
/// environment variables; tests build it by hand.
#[derive(Debug, Clone)]
pub struct HubOptions {
    /// The hub cache directory (holding `models--Org--Name` folders).
    pub cache_dir: PathBuf,
    /// Base URL of the hub, without trailing slash.
    pub endpoint: String,
    /// Access token for gated / private repos.
    pub token: Option<String>,
    /// Never touch the network; only the cache.
    pub offline: bool,
    /// Print download progress to stderr.
    pub progress: bool,
}

/// Files fetched when the repo has them.
const OPTIONAL_FILES: [&str; 4] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
];
const INDEX_FILE: &str = "model.safetensors.index.json";
const SINGLE_WEIGHTS: &str = "model.safetensors";
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

impl HubOptions {
    /// Options from the process environment: `HF_HUB_CACHE` / `HF_HOME` /
    /// `XDG_CACHE_HOME` / `HOME` for the cache, `HF_ENDPOINT`, `HF_TOKEN` (else the token
    /// file `huggingface-cli login` writes, `$HF_TOKEN_PATH` or `$HF_HOME/token`),
    /// `HF_HUB_OFFLINE`.
    pub fn from_env() -> Self {
        Self::from_vars(|k| std::env::var(k).ok())
    }

    /// [`HubOptions::from_env`] with the variables read through `var`.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Self {
        let var = |k: &str| var(k).filter(|v| !v.trim().is_empty());
        let hf_home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
            let cache = var("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
                PathBuf::from(var("HOME").unwrap_or_else(|| ".".into())).join(".cache")
            });
            cache.join("huggingface")
        });
        let cache_dir = var("HF_HUB_CACHE")
            .or_else(|| var("HUGGINGFACE_HUB_CACHE"))
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("hub"));
        let endpoint = var("HF_ENDPOINT")
            .unwrap_or_else(|| DEFAULT_ENDPOINT.into())
            .trim_end_matches('/')
            .to_string();
        let token = var("HF_TOKEN")
            .or_else(|| var("HUGGING_FACE_HUB_TOKEN"))
            .or_else(|| {
                let path = var("HF_TOKEN_PATH")
                    .map(PathBuf::from)
                    .unwrap_or_else(|| hf_home.join("token"));
                std::fs::read_to_string(path)
                    .ok()
                    .map(|t| t.trim().to_string())
                    .filter(|t| !t.is_empty())
            });
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "1" | "true" | "yes" | "on"
            )
        });
        Self {
            cache_dir,
            endpoint,
            token,
            offline,
            progress: true,
        }
    }
}

/// A parsed `Org/Name[@revision]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoRef {
    /// `Org/Name`.
    pub repo: String,
    /// Branch, tag or commit hash; `None` means `main`.
    pub revision: Option<String>,
}

impl RepoRef {
    /// The revision, `main` by default.
    pub fn revision(&self) -> &str {
        self.revision.as_deref().unwrap_or("main")
    }

    /// The repo's folder in the cache: `models--Org--Name`.
    pub fn cache_folder(&self) -> String {
        format!("models--{}", self.repo.replace('/', "--"))
    }
}

/// Whether `s` has the shape of a repo id (`Org/Name`, optional `@revision`). A caller
/// that also accepts local paths should check for an existing directory first.
pub fn looks_like_repo_id(s: &str) -> bool {
    parse_repo_id(s).is_ok()
}

/// Parses `Org/Name[@revision]`. Names are 1-96 characters of letters, digits, `-`, `_`,
/// `.`, not starting or ending with `-`/`.`, without `--` or `..`.
pub fn parse_repo_id(s: &str) -> Result<RepoRef> {
    let bad = |cause: String| Error::Hub {
        repo: s.to_string(),
        cause,
        hint: "a hub model is written `Org/Name` or `Org/Name@revision`; a local model is a \
               directory path"
            .into(),
    };
    let (repo, revision) = match s.split_once('@') {
        Some((r, rev)) => (r, Some(rev)),
        None => (s, None),
    };
    let parts: Vec<&str> = repo.split('/').collect();
    if parts.len() != 2 {
        return Err(bad("malformed repo id: expected exactly one `/`".into()));
    }
    for part in &parts {
        let ok_chars = part
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        let ok_ends = !part.starts_with(['-', '.']) && !part.ends_with(['-', '.']);
        if part.is_empty()
            || part.len() > 96
            || !ok_chars
            || !ok_ends
            || part.contains("--")
            || part.contains("..")
        {
            return Err(bad(format!(
                "malformed repo id: `{part}` is not a valid name (letters, digits, `-`, `_`, `.`)"
            )));
        }
    }
    if let Some(rev) = revision {
        let ok = !rev.is_empty()
            && !rev.starts_with('/')
            && !rev.ends_with('/')
            && rev
                .split('/')
                .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
            && rev
                .chars()
                .all(|c| !c.is_whitespace() && !c.is_control() && c != '\\');
        if !ok {
            return Err(bad(format!("malformed revision `{rev}`")));
        }
    }
    Ok(RepoRef {
        repo: repo.to_string(),
        revision: revision.map(str::to_string),
    })
}

fn is_commit_hash(s: &str) -> bool {
    s.len() == 40 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The cached snapshot of `repo` if it holds `config.json`; never touches the network.
pub fn cached_snapshot(repo: &RepoRef, opts: &HubOptions) -> Option<PathBuf> {
    let root = opts.cache_dir.join(repo.cache_folder());
    let rev = repo.revision();
    let mut candidates = Vec::new();
    if is_commit_hash(rev) {
        candidates.push(rev.to_ascii_lowercase());
    }
    if let Ok(hash) = std::fs::read_to_string(root.join("refs").join(rev)) {
        let hash = hash.trim();
        if is_commit_hash(hash) {
            candidates.push(hash.to_string());
        }
    }
    // A folder named after the revision itself (written when a server sent no commit).
    candidates.push(rev.to_string());
    candidates
        .into_iter()
        .map(|h| root.join("snapshots").join(h))
        .find(|dir| dir.join("config.json").is_file())
}

/// Resolves `Org/Name[@revision]` to a local snapshot directory, downloading it into the
/// cache when it is not there (unless offline).
pub fn resolve(repo_id: &str, opts: &HubOptions) -> Result<PathBuf> {
    let repo = parse_repo_id(repo_id)?;
    if let Some(dir) = cached_snapshot(&repo, opts) {
        return Ok(dir);
    }
    if opts.offline {
        return Err(Error::Hub {
            repo: repo_id.to_string(),
            cause: format!(
                "not in the Hugging Face cache ({}) and offline mode is on",
                opts.cache_dir.join(repo.cache_folder()).display()
            ),
            hint: format!(
                "download it where there is network (`huggingface-cli download {}`) and copy the \
                 cache folder here (or point HF_HUB_CACHE / HF_HOME at it), or pass a local \
                 model directory; unset HF_HUB_OFFLINE to download",
                repo.repo
            ),
        });
    }
    Downloader::new(repo_id, &repo, opts).run()
}

/// Metadata of one fetched file.
struct Fetched {
    body: ureq::Body,
    commit: Option<String>,
    etag: Option<String>,
    len: Option<u64>,
}

enum Outcome {
    Got(Fetched),
    /// HTTP 404, with the hub's `X-Error-Code` and `X-Error-Message`.
    NotFound(Option<String>, Option<String>),
}

struct Downloader<'a> {
    repo_id: &'a str,
    repo: &'a RepoRef,
    opts: &'a HubOptions,
    agent: ureq::Agent,
    root: PathBuf,
}

impl<'a> Downloader<'a> {
    fn new(repo_id: &'a str, repo: &'a RepoRef, opts: &'a HubOptions) -> Self {
        let host = host_of(&opts.endpoint);
        let loopback = host == "localhost" || host.starts_with("127.") || host == "[::1]";
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .max_redirects(0) // followed by hand: headers of each hop matter
            .timeout_connect(Some(Duration::from_secs(15)))
            .timeout_recv_response(Some(Duration::from_secs(60)))
            .user_agent(concat!("dflash/", env!("CARGO_PKG_VERSION")))
            .proxy(if loopback {
                None
            } else {
                ureq::Proxy::try_from_env()
            })
            .build()
            .into();
        let root = opts.cache_dir.join(repo.cache_folder());
        Self {
            repo_id,
            repo,
            opts,
            agent,
            root,
        }
    }

    fn err(&self, cause: impl Into<String>, hint: impl Into<String>) -> Error {
        Error::Hub {
            repo: self.repo_id.to_string(),
            cause: cause.into(),
            hint: hint.into(),
        }
    }

    fn run(&self) -> Result<PathBuf> {
        let rev = self.repo.revision();
        // config.json first: it checks repo, revision and access, and names the commit.
        let cfg = match self.fetch(rev, "config.json")? {
            Outcome::Got(f) => f,
            Outcome::NotFound(code, _) if code.as_deref() == Some("EntryNotFound") => {
                return Err(self.err(
                    format!("no config.json at revision `{rev}`: not a transformers model repo"),
                    "check the repo id; dflash loads repos with config.json and safetensors weights",
                ))
            }
            // Without the hub's error code a 404 on the first file means repo or revision.
            Outcome::NotFound(code, msg) => return Err(self.status_error(404, "config.json", rev, &code, &msg)),
        };
        let commit = match cfg.commit.clone().filter(|c| is_commit_hash(c)) {
            Some(c) => c.to_ascii_lowercase(),
            None if is_commit_hash(rev) => rev.to_ascii_lowercase(),
            None => {
                tracing::warn!(
                    "{}: the hub sent no X-Repo-Commit; caching under `{rev}`",
                    self.repo_id
                );
                rev.to_string()
            }
        };
        let snapshot = self.root.join("snapshots").join(&commit);
        std::fs::create_dir_all(&snapshot).map_err(|e| Error::io(&snapshot, e))?;
        // Read config.json now (small), store it last.
        let cfg_etag = cfg.etag.clone();
        let cfg_bytes = read_small(cfg.body).map_err(|e| self.interrupted("config.json", e))?;

        // Everything else at the resolved commit, so all files are of one version.
        let pin = if is_commit_hash(&commit) {
            commit.clone()
        } else {
            rev.to_string()
        };
        for file in OPTIONAL_FILES {
            self.download(&pin, file, &snapshot, false)?;
        }
        if self.download(&pin, INDEX_FILE, &snapshot, false)? {
            for shard in self.shards(&snapshot.join(INDEX_FILE))? {
                self.download(&pin, &shard, &snapshot, true)?;
            }
        } else if !self.download(&pin, SINGLE_WEIGHTS, &snapshot, false)? {
            return Err(self.err(
                format!("no {SINGLE_WEIGHTS} and no {INDEX_FILE} at revision `{rev}`"),
                "dflash needs safetensors weights; pick a repo (or revision) that has them",
            ));
        }

        self.store(
            &snapshot,
            "config.json",
            cfg_etag.as_deref(),
            &mut cfg_bytes.as_slice(),
            None,
        )?;
        if commit != rev {
            let refs = self.root.join("refs").join(rev);
            if let Some(parent) = refs.parent() {
                std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
            }
            std::fs::write(&refs, &commit).map_err(|e| Error::io(&refs, e))?;
        }
        if self.opts.progress {
            eprintln!("{}: ready in {}", self.repo_id, snapshot.display());
        }
        Ok(snapshot)
    }

    /// The shard file names listed in a safetensors index.
    fn shards(&self, index: &Path) -> Result<Vec<String>> {
        let file = index.display().to_string();
        let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::config(&file, "(json)", e.to_string()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::config(&file, "weight_map", "missing or not an object"))?;
        let mut shards = Vec::new();
        for v in map.values() {
            let name = v.as_str().ok_or_else(|| {
                Error::config(&file, "weight_map", format!("{v} is not a file name"))
            })?;
            let safe = !name.is_empty()
                && !name.starts_with('/')
                && !name.contains('\\')
                && name
                    .split('/')
                    .all(|seg| !seg.is_empty() && seg != "." && seg != "..");
            if !safe {
                return Err(Error::config(
                    &file,
                    "weight_map",
                    format!("unsafe shard file name `{name}`"),
                ));
            }
            if !shards.iter().any(|s| s == name) {
                shards.push(name.to_string());
            }
        }
        shards.sort();
        Ok(shards)
    }

    /// Downloads `file` into the snapshot unless it is there. `Ok(false)` when the repo
    /// has no such file (and `required` is false).
    fn download(&self, rev: &str, file: &str, snapshot: &Path, required: bool) -> Result<bool> {
        if snapshot.join(file).is_file() {
            return Ok(true);
        }
        match self.fetch(rev, file)? {
            Outcome::NotFound(code, msg)
                if matches!(
                    code.as_deref(),
                    Some("RepositoryNotFound" | "RevisionNotFound")
                ) =>
            {
                Err(self.status_error(404, file, rev, &code, &msg))
            }
            Outcome::NotFound(..) if required => Err(self.err(
                format!("file {file} (listed in {INDEX_FILE}) not found at revision `{rev}`"),
                "the repo is incomplete at this revision; try another revision",
            )),
            Outcome::NotFound(..) => Ok(false),
            Outcome::Got(f) => {
                let len = f.len;
                let mut reader = f.body.into_reader();
                self.store(snapshot, file, f.etag.as_deref(), &mut reader, len)?;
                Ok(true)
            }
        }
    }

    /// Writes a file into the cache: `blobs/{etag}` plus a symlink in the snapshot, or the
    /// plain file in the snapshot when there is no etag or no symlink support.
    fn store(
        &self,
        snapshot: &Path,
        file: &str,
        etag: Option<&str>,
        body: &mut dyn Read,
        len: Option<u64>,
    ) -> Result<()> {
        let link = snapshot.join(file);
        if let Some(parent) = link.parent() {
            std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        let blob = match etag {
            Some(tag) if cfg!(unix) => {
                let blobs = self.root.join("blobs");
                std::fs::create_dir_all(&blobs).map_err(|e| Error::io(&blobs, e))?;
                blobs.join(tag)
            }
            _ => link.clone(),
        };
        if !blob.is_file() {
            let tmp = blob.with_file_name(format!(
                "{}.incomplete",
                blob.file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default()
            ));
            let written = self.copy_with_progress(file, body, &tmp, len)?;
            if let Some(want) = len {
                if written != want {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(self.interrupted(file, format!("got {written} bytes of {want}")));
                }
            }
            std::fs::rename(&tmp, &blob).map_err(|e| Error::io(&blob, e))?;
        }
        if blob != link {
            #[cfg(unix)]
            {
                let depth = file.split('/').count() + 1; // up from snapshots/{hash}/{dirs..}
                let target = PathBuf::from("../".repeat(depth))
                    .join("blobs")
                    .join(blob.file_name().unwrap_or_default());
                let _ = std::fs::remove_file(&link);
                std::os::unix::fs::symlink(&target, &link).map_err(|e| Error::io(&link, e))?;
            }
        }
        Ok(())
    }

    fn copy_with_progress(
        &self,
        file: &str,
        body: &mut dyn Read,
        dest: &Path,
        len: Option<u64>,
    ) -> Result<u64> {
        const MB: f64 = 1024.0 * 1024.0;
        let mut out = std::fs::File::create(dest).map_err(|e| Error::io(dest, e))?;
        let total = len
            .map(|l| format!(" of {:.1} MB", l as f64 / MB))
            .unwrap_or_default();
        if self.opts.progress {
            eprintln!("{}: downloading {file}{total}", self.repo_id);
        }
        let mut buf = vec![0u8; 1 << 20];
        let mut written = 0u64;
        let mut next_report = 256u64 << 20;
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    drop(out);
                    let _ = std::fs::remove_file(dest);
                    return Err(self.interrupted(file, e));
                }
            };
            out.write_all(&buf[..n]).map_err(|e| Error::io(dest, e))?;
            written += n as u64;
            if self.opts.progress && written >= next_report {
                eprintln!(
                    "{}: {file}: {:.0} MB{total}",
                    self.repo_id,
                    written as f64 / MB
                );
                next_report += 256 << 20;
            }
        }
        out.flush().map_err(|e| Error::io(dest, e))?;
        if self.opts.progress {
            eprintln!(
                "{}: {file}: done, {:.1} MB",
                self.repo_id,
                written as f64 / MB
            );
        }
        Ok(written)
    }

    fn interrupted(&self, file: &str, e: impl std::fmt::Display) -> Error {
        self.err(
            format!("download of {file} from {} failed: {e}", self.opts.endpoint),
            "run again: completed files are kept in the cache",
        )
    }

    /// GET `{endpoint}/{repo}/resolve/{rev}/{file}`, following redirects, mapping failures
    /// to hub errors.
    fn fetch(&self, rev: &str, file: &str) -> Result<Outcome> {
        let endpoint = &self.opts.endpoint;
        let mut url = format!(
            "{endpoint}/{}/resolve/{}/{}",
            self.repo.repo,
            encode(rev, false),
            encode(file, true)
        );
        let (mut commit, mut etag, mut linked_etag) = (None, None, None);
        for _hop in 0..10 {
            let mut req = self.agent.get(&url);
            if let Some(token) = &self.opts.token {
                // The token goes to the hub only, never to a CDN it redirects to.
                if origin_of(&url) == origin_of(endpoint) {
                    req = req.header("Authorization", format!("Bearer {token}"));
                }
            }
            let resp = req.call().map_err(|e| self.transport_error(&url, e))?;
            let header = |name: &str| {
                resp.headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string)
            };
            let hop_commit = header("x-repo-commit");
            if commit.is_none() {
                commit = hop_commit.clone();
            }
            if linked_etag.is_none() {
                linked_etag = header("x-linked-etag");
            }
            if etag.is_none() && hop_commit.is_some() {
                etag = header("etag");
            }
            let status = resp.status().as_u16();
            match status {
                200..=299 => {
                    if etag.is_none() {
                        etag = header("etag");
                    }
                    let len = header("content-length").and_then(|l| l.parse().ok());
                    let etag = linked_etag.or(etag).and_then(|t| clean_etag(&t));
                    return Ok(Outcome::Got(Fetched {
                        body: resp.into_body(),
                        commit,
                        etag,
                        len,
                    }));
                }
                301 | 302 | 303 | 307 | 308 => {
                    let loc = header("location").ok_or_else(|| {
                        self.err(
                            format!("HTTP {status} without Location from {url}"),
                            "try again later",
                        )
                    })?;
                    url = join_url(&url, &loc);
                }
                404 => {
                    return Ok(Outcome::NotFound(
                        header("x-error-code"),
                        header("x-error-message"),
                    ))
                }
                _ => {
                    return Err(self.status_error(
                        status,
                        file,
                        rev,
                        &header("x-error-code"),
                        &header("x-error-message"),
                    ))
                }
            }
        }
        Err(self.err(
            format!("too many redirects fetching {file}"),
            "check HF_ENDPOINT",
        ))
    }

    fn status_error(
        &self,
        status: u16,
        file: &str,
        rev: &str,
        code: &Option<String>,
        msg: &Option<String>,
    ) -> Error {
        let endpoint = &self.opts.endpoint;
        let detail = msg.as_ref().map(|m| format!(" ({m})")).unwrap_or_default();
        match (status, code.as_deref()) {
            (401 | 403, Some("RepositoryNotFound")) | (404, Some("RepositoryNotFound")) => self.err(
                format!("repository not found on {endpoint} (HTTP {status}){detail}"),
                format!(
                    "check the spelling of `{}`; if it is private, set HF_TOKEN to a token that can read it",
                    self.repo.repo
                ),
            ),
            (401 | 403, _) => self.err(
                format!("access denied (HTTP {status}): the repo is gated or private{detail}"),
                format!(
                    "accept the license on {endpoint}/{} while logged in, then set HF_TOKEN to an access \
                     token of that account{}",
                    self.repo.repo,
                    if self.opts.token.is_some() { " (the current HF_TOKEN was refused)" } else { "" }
                ),
            ),
            (404, Some("RevisionNotFound")) => self.err(
                format!("revision `{rev}` not found (HTTP 404){detail}"),
                "check the spelling of the revision after `@` (a branch, tag or commit hash)",
            ),
            (404, _) => self.err(
                format!("repo or revision not found on {endpoint} (HTTP 404 for {file}){detail}"),
                format!("check the spelling of `{}` and of the revision `{rev}`", self.repo.repo),
            ),
            (429, _) => self.err(format!("rate limited by {endpoint} (HTTP 429){detail}"), "wait and try again, or set HF_TOKEN"),
            _ => self.err(
                format!("HTTP {status} from {endpoint} for {file}{detail}"),
                "try again later; if it persists, download elsewhere and pass a local directory",
            ),
        }
    }

    fn transport_error(&self, url: &str, e: ureq::Error) -> Error {
        use std::io::ErrorKind as K;
        let unreachable = match &e {
            ureq::Error::HostNotFound | ureq::Error::ConnectionFailed | ureq::Error::Timeout(_) => {
                true
            }
            ureq::Error::Io(io) => matches!(
                io.kind(),
                K::ConnectionRefused
                    | K::ConnectionReset
                    | K::ConnectionAborted
                    | K::NotConnected
                    | K::AddrNotAvailable
                    | K::TimedOut
                    | K::HostUnreachable
                    | K::NetworkUnreachable
                    | K::NotFound
            ),
            _ => false,
        };
        let host = origin_of(url);
        if unreachable {
            self.err(
                format!("no network access to {host} ({e})"),
                "download the model where there is network and pass its local directory, or \
                 populate the Hugging Face cache (HF_HUB_CACHE) with it; set HF_ENDPOINT for a mirror",
            )
        } else {
            self.err(
                format!("request to {host} failed: {e}"),
                "check HF_ENDPOINT and the network, then try again",
            )
        }
    }
}

/// Reads a small body (config.json) fully.
fn read_small(body: ureq::Body) -> std::result::Result<Vec<u8>, ureq::Error> {
    body.into_with_config().limit(64 << 20).read_to_vec()
}

/// An ETag usable as a blob file name: quotes and `W/` removed, only `[A-Za-z0-9-_.]`.
fn clean_etag(tag: &str) -> Option<String> {
    let t = tag.trim().trim_start_matches("W/").trim_matches('"');
    let ok = !t.is_empty()
        && t.len() <= 128
        && t.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_'));
    ok.then(|| t.to_string())
}

/// Percent-encodes a URL path component (`keep_slash`: a path of several segments).
fn encode(s: &str, keep_slash: bool) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric()
            || matches!(b, b'-' | b'_' | b'.' | b'~')
            || (keep_slash && b == b'/')
        {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// `scheme://host[:port]` of a URL.
fn origin_of(url: &str) -> &str {
    let after_scheme = url.find("://").map(|i| i + 3).unwrap_or(0);
    let end = url[after_scheme..]
        .find('/')
        .map(|i| after_scheme + i)
        .unwrap_or(url.len());
    &url[..end]
}

/// The host of a URL (without port).
fn host_of(url: &str) -> String {
    let origin = origin_of(url);
    let host = origin.split_once("://").map(|(_, h)| h).unwrap_or(origin);
    let host = host.rsplit_once('@').map(|(_, h)| h).unwrap_or(host);
    if host.starts_with('[') {
        return host.split_inclusive(']').next().unwrap_or(host).to_string();
    }
    host.split(':').next().unwrap_or(host).to_ascii_lowercase()
}

/// Resolves a redirect `Location` against the URL it came from.
fn join_url(base: &str, loc: &str) -> String {
    if loc.contains("://") {
        loc.to_string()
    } else if let Some(rest) = loc.strip_prefix("//") {
        let scheme = base.split("://").next().unwrap_or("https");
        format!("{scheme}://{rest}")
    } else if loc.starts_with('/') {
        format!("{}{loc}", origin_of(base))
    } else {
        let dir = base.rsplit_once('/').map(|(d, _)| d).unwrap_or(base);
        format!("{dir}/{loc}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::io::BufRead;
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};

    const HASH: &str = "0123456789abcdef0123456789abcdef01234567";
    const HASH2: &str = "fedcba9876543210fedcba9876543210fedcba98";

    fn opts(cache: &Path, endpoint: &str) -> HubOptions {
        HubOptions {
            cache_dir: cache.to_path_buf(),
            endpoint: endpoint.into(),
            token: None,
            offline: false,
            progress: false,
        }
    }

    /// Lays out `models--{org}--{name}` with a snapshot per (ref, hash).
    fn lay_out(cache: &Path, repo: &str, refs: &[(&str, &str)], with_config: bool) -> PathBuf {
        let root = cache.join(format!("models--{}", repo.replace('/', "--")));
        for (r, hash) in refs {
            let refp = root.join("refs").join(r);
            std::fs::create_dir_all(refp.parent().unwrap()).unwrap();
            std::fs::write(&refp, format!("{hash}\n")).unwrap();
            let snap = root.join("snapshots").join(hash);
            std::fs::create_dir_all(&snap).unwrap();
            std::fs::create_dir_all(root.join("blobs")).unwrap();
            if with_config {
                // As in a real cache: a symlink into blobs/.
                let blob = root.join("blobs").join(format!("blob{hash}"));
                std::fs::write(&blob, format!("{{\"hash\": \"{hash}\"}}")).unwrap();
                std::os::unix::fs::symlink(
                    format!("../../blobs/blob{hash}"),
                    snap.join("config.json"),
                )
                .unwrap();
            }
        }
        root
    }

    fn hub_err(e: Error) -> (String, String, String) {
        match e {
            Error::Hub { repo, cause, hint } => (repo, cause, hint),
            other => panic!("expected a hub error, got {other:?}"),
        }
    }

    #[test]
    fn env_vars_to_options() {
        let vars: HashMap<&str, &str> = [
            ("HF_HOME", "/h"),
            ("HF_HUB_OFFLINE", "1"),
            ("HF_TOKEN", "tok"),
            ("HF_ENDPOINT", "http://m/"),
        ]
        .into();
        let o = HubOptions::from_vars(|k| vars.get(k).map(|v| v.to_string()));
        assert_eq!(o.cache_dir, PathBuf::from("/h/hub"));
        assert!(o.offline);
        assert_eq!(o.token.as_deref(), Some("tok"));
        assert_eq!(o.endpoint, "http://m");
        let vars: HashMap<&str, &str> = [
            ("HF_HOME", "/h"),
            ("HF_HUB_CACHE", "/c"),
            ("HF_HUB_OFFLINE", "0"),
        ]
        .into();
        let o = HubOptions::from_vars(|k| vars.get(k).map(|v| v.to_string()));
        assert_eq!(o.cache_dir, PathBuf::from("/c"));
        assert!(!o.offline);
        assert_eq!(o.endpoint, "https://huggingface.co");
        let vars: HashMap<&str, &str> =
            [("HOME", "/home/u"), ("HF_TOKEN_PATH", "/nonexistent/token")].into();
        let o = HubOptions::from_vars(|k| vars.get(k).map(|v| v.to_string()));
        assert_eq!(o.cache_dir, PathBuf::from("/home/u/.cache/huggingface/hub"));
        assert_eq!(o.token, None);
        // The token file of `huggingface-cli login`.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("token"), "hf_file\n").unwrap();
        let home = dir.path().to_str().unwrap().to_string();
        let o = HubOptions::from_vars(|k| (k == "HF_HOME").then(|| home.clone()));
        assert_eq!(o.token.as_deref(), Some("hf_file"));
    }

    #[test]
    fn repo_id_parsing() {
        assert_eq!(
            parse_repo_id("Qwen/Qwen3-8B").unwrap(),
            RepoRef {
                repo: "Qwen/Qwen3-8B".into(),
                revision: None
            }
        );
        let r = parse_repo_id("z-lab/Qwen3-8B-DFlash-b16@refs/pr/1").unwrap();
        assert_eq!(r.revision(), "refs/pr/1");
        assert_eq!(r.cache_folder(), "models--z-lab--Qwen3-8B-DFlash-b16");
        for bad in [
            "Qwen3-8B",
            "a/b/c",
            "/x",
            "x/",
            "a b/c",
            "a/b@",
            "a/b@../../etc",
            "../x/y",
            "a--b/c",
            "a/.b",
            "./models",
        ] {
            let (repo, cause, hint) = hub_err(parse_repo_id(bad).unwrap_err());
            assert_eq!(repo, bad);
            assert!(cause.contains("malformed"), "{bad}: {cause}");
            assert!(hint.contains("Org/Name"), "{hint}");
            assert!(!looks_like_repo_id(bad));
        }
    }

    #[test]
    fn cache_refs_main_to_hash() {
        let cache = tempfile::tempdir().unwrap();
        let root = lay_out(
            cache.path(),
            "Org/Model",
            &[("main", HASH), ("v2", HASH2)],
            true,
        );
        let mut o = opts(cache.path(), "http://127.0.0.1:9");
        o.offline = true;
        let dir = resolve("Org/Model", &o).unwrap();
        assert_eq!(dir, root.join("snapshots").join(HASH));
        // Reads through the symlink.
        assert!(std::fs::read_to_string(dir.join("config.json"))
            .unwrap()
            .contains(HASH));
        // Also when not offline: no network needed (the endpoint is a closed port).
        o.offline = false;
        assert_eq!(
            resolve("Org/Model", &o).unwrap(),
            root.join("snapshots").join(HASH)
        );
    }

    #[test]
    fn cache_explicit_revision_and_commit_hash() {
        let cache = tempfile::tempdir().unwrap();
        let root = lay_out(
            cache.path(),
            "Org/Model",
            &[("main", HASH), ("v2", HASH2)],
            true,
        );
        let mut o = opts(cache.path(), "http://127.0.0.1:9");
        o.offline = true;
        assert_eq!(
            resolve("Org/Model@v2", &o).unwrap(),
            root.join("snapshots").join(HASH2)
        );
        assert_eq!(
            resolve(&format!("Org/Model@{HASH2}"), &o).unwrap(),
            root.join("snapshots").join(HASH2)
        );
        // Unknown revision: not cached.
        let (_, cause, _) = hub_err(resolve("Org/Model@v3", &o).unwrap_err());
        assert!(cause.contains("not in the Hugging Face cache"), "{cause}");
    }

    #[test]
    fn offline_missing_repo_errors_with_hint() {
        let cache = tempfile::tempdir().unwrap();
        // A snapshot without config.json does not count.
        lay_out(cache.path(), "Org/Partial", &[("main", HASH)], false);
        let mut o = opts(cache.path(), "http://127.0.0.1:9");
        o.offline = true;
        for repo in ["Org/Missing", "Org/Partial"] {
            let e = resolve(repo, &o).unwrap_err();
            let text = e.to_string();
            let (r, cause, hint) = hub_err(e);
            assert_eq!(r, repo);
            assert!(text.contains(repo), "{text}");
            assert!(cause.contains("offline"), "{cause}");
            assert!(
                hint.contains("local model directory") && hint.contains("HF_HUB_OFFLINE"),
                "{hint}"
            );
        }
    }

    /// A canned-response HTTP server on 127.0.0.1. `route(path) -> (status, headers, body)`.
    /// Records each request line and its Authorization header. Stops after `max_conns`
    /// connections or 30 s.
    struct Server {
        url: String,
        log: Arc<Mutex<Vec<(String, Option<String>)>>>,
    }

    type Route = dyn Fn(&str) -> (u16, Vec<(String, String)>, Vec<u8>) + Send + Sync;

    fn serve(max_conns: usize, route: Box<Route>) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        listener.set_nonblocking(true).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let log2 = log.clone();
        std::thread::spawn(move || {
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            let mut served = 0;
            while served < max_conns && std::time::Instant::now() < deadline {
                let (stream, _) = match listener.accept() {
                    Ok(s) => s,
                    Err(_) => {
                        std::thread::sleep(Duration::from_millis(5));
                        continue;
                    }
                };
                served += 1;
                stream.set_nonblocking(false).unwrap();
                stream
                    .set_read_timeout(Some(Duration::from_secs(5)))
                    .unwrap();
                let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                if reader.read_line(&mut line).is_err() {
                    continue;
                }
                let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
                let mut auth = None;
                loop {
                    let mut h = String::new();
                    if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                        break;
                    }
                    if let Some((k, v)) = h.split_once(':') {
                        if k.eq_ignore_ascii_case("authorization") {
                            auth = Some(v.trim().to_string());
                        }
                    }
                }
                log2.lock().unwrap().push((path.clone(), auth));
                let (status, headers, body) = route(&path);
                let mut resp = format!(
                    "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n",
                    body.len()
                );
                for (k, v) in headers {
                    resp.push_str(&format!("{k}: {v}\r\n"));
                }
                resp.push_str("\r\n");
                let mut stream = stream;
                let _ = stream.write_all(resp.as_bytes());
                let _ = stream.write_all(&body);
                let _ = stream.flush();
            }
        });
        Server { url, log }
    }

    fn h(k: &str, v: &str) -> (String, String) {
        (k.to_string(), v.to_string())
    }

    /// A fake hub serving a sharded repo: files at `/Org/Model/resolve/{main|HASH}/..`;
    /// shards go through a redirect to a second server (the "CDN", another origin) as LFS
    /// files do. Returns (hub, cdn).
    fn fake_hub() -> (Server, Server) {
        let index = r#"{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}}"#;
        let files: HashMap<&'static str, Vec<u8>> = [
            ("config.json", br#"{"model_type": "qwen3"}"#.to_vec()),
            ("tokenizer.json", b"{}".to_vec()),
            (
                "tokenizer_config.json",
                br#"{"eos_token": "<|im_end|>"}"#.to_vec(),
            ),
            ("model.safetensors.index.json", index.as_bytes().to_vec()),
            ("model-00001-of-00002.safetensors", vec![1u8; 3000]),
            ("model-00002-of-00002.safetensors", vec![2u8; 5000]),
        ]
        .into();
        let files = Arc::new(files);
        let cdn_files = files.clone();
        let cdn = serve(
            10,
            Box::new(
                move |path| match path.strip_prefix("/cdn/").and_then(|n| cdn_files.get(n)) {
                    Some(body) => (200, vec![h("ETag", "\"cdn-etag\"")], body.clone()),
                    None => (404, vec![], vec![]),
                },
            ),
        );
        let cdn_url = cdn.url.clone();
        let hub = serve(
            40,
            Box::new(move |path| {
                let rest = path.strip_prefix("/Org/Model/resolve/");
                let Some((rev, name)) = rest.and_then(|r| r.split_once('/')) else {
                    return (
                        401,
                        vec![h("X-Error-Code", "RepositoryNotFound")],
                        b"nope".to_vec(),
                    );
                };
                if rev != "main" && rev != HASH {
                    return (404, vec![h("X-Error-Code", "RevisionNotFound")], vec![]);
                }
                let Some(body) = files.get(name) else {
                    return (404, vec![h("X-Error-Code", "EntryNotFound")], vec![]);
                };
                let etag = format!("etag-{}", name.replace('.', "-"));
                if name.ends_with(".safetensors") {
                    let loc = format!("{cdn_url}/cdn/{name}");
                    (
                        302,
                        vec![
                            h("Location", &loc),
                            h("X-Repo-Commit", HASH),
                            h("X-Linked-Etag", &format!("\"{etag}\"")),
                        ],
                        vec![],
                    )
                } else {
                    (
                        200,
                        vec![h("X-Repo-Commit", HASH), h("ETag", &format!("\"{etag}\""))],
                        body.clone(),
                    )
                }
            }),
        );
        (hub, cdn)
    }

    #[test]
    fn download_into_cache_then_resolve_from_it() {
        let cache = tempfile::tempdir().unwrap();
        let (server, cdn) = fake_hub();
        let mut o = opts(cache.path(), &server.url);
        o.token = Some("secret".into());
        let dir = resolve("Org/Model", &o).unwrap();
        let root = cache.path().join("models--Org--Model");
        assert_eq!(dir, root.join("snapshots").join(HASH));
        assert_eq!(
            std::fs::read_to_string(root.join("refs/main")).unwrap(),
            HASH
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("config.json")).unwrap(),
            r#"{"model_type": "qwen3"}"#
        );
        assert_eq!(
            std::fs::read(dir.join("model-00002-of-00002.safetensors")).unwrap(),
            vec![2u8; 5000]
        );
        assert_eq!(
            std::fs::read(dir.join("model-00001-of-00002.safetensors"))
                .unwrap()
                .len(),
            3000
        );
        assert!(
            dir.join("tokenizer.json").is_file() && dir.join("tokenizer_config.json").is_file()
        );
        assert!(
            !dir.join("generation_config.json").exists(),
            "optional file absent upstream"
        );
        // huggingface_hub's layout: symlinks into blobs named by the (linked) etag.
        let link = std::fs::read_link(dir.join("model-00001-of-00002.safetensors")).unwrap();
        assert_eq!(
            link,
            PathBuf::from("../../blobs/etag-model-00001-of-00002-safetensors")
        );
        assert!(root.join("blobs/etag-config-json").is_file());
        assert!(!std::fs::read_dir(root.join("blobs")).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .ends_with(".incomplete")));

        let log = server.log.lock().unwrap().clone();
        // config.json at `main`, everything else pinned to the commit it named.
        assert_eq!(log[0].0, "/Org/Model/resolve/main/config.json");
        assert!(log[1..].iter().all(|(p, _)| p.contains(HASH)), "{log:?}");
        // The token goes to the hub, not to the CDN.
        assert!(
            log.iter()
                .all(|(_, auth)| auth.as_deref() == Some("Bearer secret")),
            "{log:?}"
        );
        let cdn_log = cdn.log.lock().unwrap().clone();
        assert!(
            cdn_log.iter().all(|(_, auth)| auth.is_none()),
            "{cdn_log:?}"
        );
        // Each shard once, though the index lists one twice.
        let mut got: Vec<&str> = cdn_log.iter().map(|(p, _)| p.as_str()).collect();
        got.sort();
        assert_eq!(
            got,
            [
                "/cdn/model-00001-of-00002.safetensors",
                "/cdn/model-00002-of-00002.safetensors"
            ]
        );

        // Now in the cache: resolves offline, and without requests.
        let n = log.len();
        o.offline = true;
        assert_eq!(resolve("Org/Model", &o).unwrap(), dir);
        o.offline = false;
        assert_eq!(resolve("Org/Model@main", &o).unwrap(), dir);
        assert_eq!(resolve(&format!("Org/Model@{HASH}"), &o).unwrap(), dir);
        assert_eq!(server.log.lock().unwrap().len(), n);
    }

    #[test]
    fn single_file_weights_without_tokenizer() {
        let server = serve(
            20,
            Box::new(|path| match path.rsplit('/').next().unwrap() {
                "config.json" => (200, vec![h("X-Repo-Commit", HASH)], b"{}".to_vec()),
                "model.safetensors" => (200, vec![h("X-Repo-Commit", HASH)], vec![7u8; 100]),
                _ => (404, vec![h("X-Error-Code", "EntryNotFound")], vec![]),
            }),
        );
        let cache = tempfile::tempdir().unwrap();
        let dir = resolve("Org/Draft@main", &opts(cache.path(), &server.url)).unwrap();
        // No ETag: plain files in the snapshot.
        assert_eq!(
            std::fs::read(dir.join("model.safetensors")).unwrap(),
            vec![7u8; 100]
        );
        assert!(!std::fs::symlink_metadata(dir.join("model.safetensors"))
            .unwrap()
            .file_type()
            .is_symlink());
        assert!(!dir.join("tokenizer.json").exists());
    }

    #[test]
    fn no_weights_is_an_error() {
        let server = serve(
            20,
            Box::new(|path| match path.rsplit('/').next().unwrap() {
                "config.json" => (200, vec![h("X-Repo-Commit", HASH)], b"{}".to_vec()),
                _ => (404, vec![h("X-Error-Code", "EntryNotFound")], vec![]),
            }),
        );
        let cache = tempfile::tempdir().unwrap();
        let (_, cause, _) =
            hub_err(resolve("Org/Model", &opts(cache.path(), &server.url)).unwrap_err());
        assert!(cause.contains("model.safetensors"), "{cause}");
        // And not taken for a complete snapshot afterwards.
        let mut o = opts(cache.path(), &server.url);
        o.offline = true;
        assert!(resolve("Org/Model", &o).is_err());
    }

    #[test]
    fn http_401_is_gated() {
        let server = serve(
            5,
            Box::new(|_| (401, vec![h("X-Error-Code", "GatedRepo")], b"gated".to_vec())),
        );
        let cache = tempfile::tempdir().unwrap();
        let e = resolve("meta-llama/Llama-3.1-8B", &opts(cache.path(), &server.url)).unwrap_err();
        let (repo, cause, hint) = hub_err(e);
        assert_eq!(repo, "meta-llama/Llama-3.1-8B");
        assert!(cause.contains("401") && cause.contains("gated"), "{cause}");
        assert!(
            hint.contains("HF_TOKEN") && hint.contains("license"),
            "{hint}"
        );
        assert!(!cache
            .path()
            .join("models--meta-llama--Llama-3.1-8B/refs")
            .exists());
        // 403 without an error code: the same.
        let server = serve(5, Box::new(|_| (403, vec![], vec![])));
        let (_, cause, _) =
            hub_err(resolve("Org/Model", &opts(cache.path(), &server.url)).unwrap_err());
        assert!(cause.contains("gated or private"), "{cause}");
    }

    #[test]
    fn http_404_is_not_found() {
        let server = serve(5, Box::new(|_| (404, vec![], b"Not Found".to_vec())));
        let cache = tempfile::tempdir().unwrap();
        let (repo, cause, hint) =
            hub_err(resolve("Org/Nope", &opts(cache.path(), &server.url)).unwrap_err());
        assert_eq!(repo, "Org/Nope");
        assert!(
            cause.contains("not found") && cause.contains("404"),
            "{cause}"
        );
        assert!(hint.contains("spelling"), "{hint}");
        // The hub's own codes.
        let (server, _cdn) = fake_hub();
        let (_, cause, hint) =
            hub_err(resolve("Org/Model@nobranch", &opts(cache.path(), &server.url)).unwrap_err());
        assert!(cause.contains("revision `nobranch` not found"), "{cause}");
        assert!(hint.contains("spelling"), "{hint}");
        let (_, cause, hint) =
            hub_err(resolve("Org/Other", &opts(cache.path(), &server.url)).unwrap_err());
        assert!(cause.contains("repository not found"), "{cause}");
        assert!(hint.contains("spelling"), "{hint}");
    }

    #[test]
    fn closed_port_is_unreachable() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let endpoint = format!("http://127.0.0.1:{port}");
        let cache = tempfile::tempdir().unwrap();
        let (repo, cause, hint) =
            hub_err(resolve("Org/Model", &opts(cache.path(), &endpoint)).unwrap_err());
        assert_eq!(repo, "Org/Model");
        assert!(
            cause.contains(&format!("no network access to {endpoint}")),
            "{cause}"
        );
        assert!(
            hint.contains("local directory") && hint.contains("cache"),
            "{hint}"
        );
    }

    #[test]
    fn truncated_body_is_an_error_and_leaves_no_file() {
        // Content-Length larger than the body sent: the connection closes early.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for _ in 0..10 {
                let Ok((mut s, _)) = listener.accept() else {
                    return;
                };
                let mut reader = std::io::BufReader::new(s.try_clone().unwrap());
                let mut line = String::new();
                let _ = reader.read_line(&mut line);
                loop {
                    let mut h = String::new();
                    if reader.read_line(&mut h).unwrap_or(0) == 0 || h == "\r\n" {
                        break;
                    }
                }
                let resp = if line.contains("config.json") {
                    format!("HTTP/1.1 200 OK\r\nX-Repo-Commit: {HASH}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}")
                } else if line.contains("/model.safetensors ") {
                    format!("HTTP/1.1 200 OK\r\nX-Repo-Commit: {HASH}\r\nETag: \"w\"\r\nContent-Length: 1000\r\nConnection: close\r\n\r\nshort")
                } else {
                    "HTTP/1.1 404 Not Found\r\nX-Error-Code: EntryNotFound\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_string()
                };
                let _ = s.write_all(resp.as_bytes());
            }
        });
        let cache = tempfile::tempdir().unwrap();
        let o = opts(cache.path(), &url);
        let (_, cause, hint) = hub_err(resolve("Org/Model", &o).unwrap_err());
        assert!(cause.contains("model.safetensors"), "{cause}");
        assert!(hint.contains("run again"), "{hint}");
        let blobs = cache.path().join("models--Org--Model/blobs");
        let left: Vec<_> = std::fs::read_dir(&blobs)
            .map(|d| d.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{left:?}");
    }

    #[test]
    fn url_helpers() {
        assert_eq!(encode("refs/pr/1", false), "refs%2Fpr%2F1");
        assert_eq!(encode("sub dir/a.json", true), "sub%20dir/a.json");
        assert_eq!(
            origin_of("https://huggingface.co/a/b"),
            "https://huggingface.co"
        );
        assert_eq!(host_of("http://127.0.0.1:8080/x"), "127.0.0.1");
        assert_eq!(host_of("http://[::1]:8080"), "[::1]");
        assert_eq!(join_url("https://h/a/b", "/c/d"), "https://h/c/d");
        assert_eq!(join_url("https://h/a/b", "https://cdn/x"), "https://cdn/x");
        assert_eq!(join_url("https://h/a/b", "c"), "https://h/a/c");
        assert_eq!(clean_etag("W/\"abc-1\""), Some("abc-1".into()));
        assert_eq!(clean_etag("\"../x\""), None);
    }
}
