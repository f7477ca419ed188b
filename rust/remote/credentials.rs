//! Credentials object_store does not read itself: the Hugging Face token and the AWS profile.

use std::path::{Path, PathBuf};

use object_store::aws::AmazonS3ConfigKey;

/// Token and AWS settings files longer than this are not read.
const SETTINGS_FILE_LIMIT: u64 = 1 << 20;

/// The Hugging Face token from the standard places, for private repos.
pub(super) fn hf_token() -> Option<String> {
    for var in ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"] {
        if let Ok(t) = std::env::var(var) {
            if !t.trim().is_empty() {
                return Some(t.trim().to_owned());
            }
        }
    }
    let file = match std::env::var("HF_TOKEN_PATH") {
        Ok(p) => PathBuf::from(p),
        Err(_) => {
            let home = std::env::var("HF_HOME").map(PathBuf::from).ok().or_else(|| {
                std::env::var("HOME")
                    .ok()
                    .map(|h| PathBuf::from(h).join(".cache").join("huggingface"))
            })?;
            home.join("token")
        }
    };
    crate::open::read_small_text(&file, SETTINGS_FILE_LIMIT)
        .map(|t| t.trim().to_owned())
        .filter(|t| !t.is_empty())
}

/// `key = value` pairs of one section of an AWS-style INI file.
fn ini_section(path: &Path, section: &str) -> Vec<(String, String)> {
    let Some(text) = crate::open::read_small_text(path, SETTINGS_FILE_LIMIT) else {
        return Vec::new();
    };
    let mut inside = false;
    let mut out = Vec::new();
    for line in text.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            inside = name.trim() == section;
        } else if inside {
            if let Some((k, v)) = line.split_once('=') {
                out.push((k.trim().to_owned(), v.trim().to_owned()));
            }
        }
    }
    out
}

/// Credentials and region of the AWS profile (`~/.aws/credentials`, `~/.aws/config`), which
/// object_store does not read itself; environment variables and storage options win.
pub(super) fn aws_profile() -> Vec<(AmazonS3ConfigKey, String)> {
    let Some(home) = std::env::var_os("HOME").map(PathBuf::from) else {
        return Vec::new();
    };
    let profile = std::env::var("AWS_PROFILE").unwrap_or_else(|_| "default".to_owned());
    let creds = std::env::var_os("AWS_SHARED_CREDENTIALS_FILE")
        .map_or_else(|| home.join(".aws").join("credentials"), PathBuf::from);
    let config = std::env::var_os("AWS_CONFIG_FILE").map_or_else(|| home.join(".aws").join("config"), PathBuf::from);
    let config_section = if profile == "default" {
        profile.clone()
    } else {
        format!("profile {profile}")
    };
    let mut out = Vec::new();
    for (k, v) in ini_section(&creds, &profile)
        .into_iter()
        .chain(ini_section(&config, &config_section))
    {
        let key = match k.as_str() {
            "aws_access_key_id" => AmazonS3ConfigKey::AccessKeyId,
            "aws_secret_access_key" => AmazonS3ConfigKey::SecretAccessKey,
            "aws_session_token" => AmazonS3ConfigKey::Token,
            "region" => AmazonS3ConfigKey::Region,
            "endpoint_url" => AmazonS3ConfigKey::Endpoint,
            _ => continue,
        };
        out.push((key, v));
    }
    out
}
