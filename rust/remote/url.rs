//! URL parsing: what a URL names (the store to build and the key inside it).

use crate::error::{AdapterErrorCode, Error};

/// What a URL names: the store's cache key and how to build it, and the key inside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Parsed {
    pub kind: Kind,
    /// `s3://bucket`, `http://host:port`, or for hf the Hub endpoint: every repo there shares one
    /// store, so one connection pool serves a fleet spread over many repos.
    pub base: String,
    pub key: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    S3,
    Gcs,
    Azure,
    Http,
    HuggingFace,
}

pub(super) fn invalid(url: &str, why: impl Into<String>) -> Error {
    Error::adapter(url, AdapterErrorCode::InvalidUrl, why.into())
}

pub(super) fn parse_url(url: &str) -> Result<Parsed, Error> {
    let (scheme, rest) = url.split_once("://").ok_or_else(|| invalid(url, "not a URL"))?;
    if scheme == "hf" {
        return parse_hf(url, rest);
    }
    let parsed = url::Url::parse(url).map_err(|e| invalid(url, format!("cannot parse this URL: {e}")))?;
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(invalid(
            url,
            "query strings and fragments are not supported in adapter URLs",
        ));
    }
    let kind = match scheme {
        "s3" | "s3a" => Kind::S3,
        "gs" | "gcs" => Kind::Gcs,
        "az" | "azure" | "abfs" | "abfss" => Kind::Azure,
        "http" | "https" => Kind::Http,
        _ => return Err(invalid(url, format!("unsupported scheme {scheme:?}"))),
    };
    if parsed.authority().is_empty() {
        return Err(invalid(url, "no bucket, container or host in this URL"));
    }
    let base = format!("{scheme}://{}", parsed.authority());
    Ok(Parsed {
        kind,
        base,
        key: parsed.path().trim_start_matches('/').to_owned(),
    })
}

/// `hf://[datasets/|spaces/]org/repo[@revision]/path` -> `{HF_ENDPOINT}/[datasets/]org/repo/resolve/{revision}/path`,
/// as the endpoint (the store) and the rest (the key).
fn parse_hf(url: &str, rest: &str) -> Result<Parsed, Error> {
    let (kind, rest) = match rest.split_once('/') {
        Some((k @ ("datasets" | "spaces" | "models"), r)) => (if k == "models" { "" } else { k }, r),
        _ => ("", rest),
    };
    let mut parts = rest.splitn(3, '/');
    let (Some(org), Some(repo)) = (parts.next(), parts.next()) else {
        return Err(invalid(url, "expected hf://org/repo[@revision]/path"));
    };
    let (repo, revision) = repo.split_once('@').unwrap_or((repo, "main"));
    if org.is_empty() || repo.is_empty() || revision.is_empty() {
        return Err(invalid(url, "expected hf://org/repo[@revision]/path"));
    }
    let endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".to_owned());
    let endpoint = endpoint.trim_end_matches('/');
    let repo_path = if kind.is_empty() {
        format!("{org}/{repo}")
    } else {
        format!("{kind}/{org}/{repo}")
    };
    Ok(Parsed {
        kind: Kind::HuggingFace,
        base: endpoint.to_owned(),
        key: format!("{repo_path}/resolve/{revision}/{}", parts.next().unwrap_or("")),
    })
}
