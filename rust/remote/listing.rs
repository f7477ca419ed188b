//! Discovery on a listing: object store prefixes are listed and the local rules apply
//! (`scan.rs`); web servers cannot be listed, so their URLs are taken for a file or a PEFT folder.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::atomic::Ordering;

use futures_util::TryStreamExt;
use object_store::path::Path as Key;
use object_store::ObjectStoreExt;

use super::loading::{NO_WEIGHTS_WHY, REMOTE_PICKLE_WHY};
use super::request::io_err;
use super::stores::{Loc, Remote};
use super::{ObjectStat, Stat};
use crate::error::{AdapterErrorCode, Error};
use crate::scan::{Target, CONFIG_NAME, PEFT_WEIGHTS};

impl Remote {
    pub(super) async fn discover(&self, url: &str, recursive: bool) -> Vec<Result<Target, Error>> {
        let loc = match self.loc(url) {
            Ok(l) => l,
            Err(e) => return vec![Err(e)],
        };
        if names_file(&loc.key) || !loc.store.listable {
            return vec![Ok(guess_target(url, &loc))];
        }
        let listed = match self.list(&loc).await {
            Ok(l) => l,
            Err(e) => return vec![Err(e)],
        };
        if listed.is_empty() {
            return vec![self.lone_object(&loc).await];
        }
        let mut tree = Dir::default();
        for parts in listed {
            tree.insert(&parts);
        }
        let mut out = Vec::new();
        tree.walk(url, recursive, true, &mut out);
        out
    }

    /// Every object under a prefix, as key parts relative to it.
    async fn list(&self, loc: &Loc) -> Result<Vec<Vec<String>>, Error> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|e| Error::adapter(&loc.url, AdapterErrorCode::Internal, e.to_string()))?;
        self.check_stalled(loc)?;
        let prefix = (!loc.key.as_ref().is_empty()).then_some(&loc.key);
        let depth = loc.key.parts().count();
        let objects: Vec<object_store::ObjectMeta> = loc
            .store
            .inner
            .list(prefix)
            .try_collect()
            .await
            .map_err(|e| self.fail(loc, &e, false))?;
        loc.store.stalls.store(0, Ordering::Relaxed);
        let keep = self.keep_listed.load(Ordering::Relaxed);
        let mut listed = Vec::with_capacity(objects.len());
        let mut stats = Vec::new();
        for o in objects {
            let parts: Vec<String> = o.location.parts().skip(depth).map(|p| p.as_ref().to_owned()).collect();
            if parts.is_empty() {
                continue;
            }
            if keep {
                // The URL `Dir::walk` gives this object: the prefix's URL and the parts, joined by '/'.
                stats.push((join(&loc.url, &parts.join("/")), object_stat(&o)));
            }
            listed.push(parts);
        }
        if keep {
            self.listed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(stats);
        }
        Ok(listed)
    }

    /// What the store says about the object at `url`: the listing's answer when this call listed
    /// it, else a `HEAD` (`Stat::Unknown` when that fails for another reason than "not found").
    pub(super) async fn stat(&self, url: &str) -> Stat {
        if let Some(s) = self
            .listed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(url)
        {
            return Stat::Found(s.clone());
        }
        let Ok(loc) = self.loc(url) else {
            return Stat::Unknown;
        };
        let Ok(_permit) = self.permits.acquire().await else {
            return Stat::Unknown;
        };
        if self.check_stalled(&loc).is_err() {
            return Stat::Unknown;
        }
        match loc.store.inner.head(&loc.key).await {
            Ok(o) => Stat::Found(object_stat(&o)),
            Err(object_store::Error::NotFound { .. }) => Stat::Missing,
            Err(e) => {
                let _ = self.fail(&loc, &e, false); // counts a timeout against the store
                Stat::Unknown
            }
        }
    }

    /// A URL with nothing under it as a prefix: the object itself, or not found.
    async fn lone_object(&self, loc: &Loc) -> Result<Target, Error> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|e| Error::adapter(&loc.url, AdapterErrorCode::Internal, e.to_string()))?;
        match loc.store.inner.head(&loc.key).await {
            Ok(_) => Ok(guess_target(&loc.url, loc)),
            Err(object_store::Error::NotFound { .. }) => Err(io_err(
                &loc.url,
                io::ErrorKind::NotFound,
                "no such object, and no objects under this prefix",
            )),
            Err(e) => Err(self.fail(loc, &e, false)),
        }
    }

    /// The single adapter at a URL (`scan::locate`'s rules on a listing of one level).
    pub(super) async fn locate(&self, url: &str) -> Result<Target, Error> {
        let loc = self.loc(url)?;
        if names_file(&loc.key) || !loc.store.listable {
            return Ok(guess_target(url, &loc));
        }
        let listing = {
            let _permit = self
                .permits
                .acquire()
                .await
                .map_err(|e| Error::adapter(url, AdapterErrorCode::Internal, e.to_string()))?;
            self.check_stalled(&loc)?;
            let prefix = (!loc.key.as_ref().is_empty()).then_some(&loc.key);
            loc.store
                .inner
                .list_with_delimiter(prefix)
                .await
                .map_err(|e| self.fail(&loc, &e, false))?
        };
        let mut dir = Dir::default();
        for o in &listing.objects {
            if let Some(name) = o.location.filename() {
                dir.insert(&[name.to_owned()]);
            }
        }
        if dir.files.contains(CONFIG_NAME) {
            return dir.peft(url);
        }
        let files: Vec<&String> = dir.safetensors().collect();
        match files.as_slice() {
            [one] => Ok(Target {
                path: url.into(),
                weights: join(url, one).into(),
                config: None,
            }),
            [] if listing.objects.is_empty() && listing.common_prefixes.is_empty() => self.lone_object(&loc).await,
            [] => Err(Error::adapter(
                url,
                AdapterErrorCode::NoAdapter,
                "no adapter_config.json and no .safetensors file in this folder",
            )),
            _ => Err(Error::adapter(
                url,
                AdapterErrorCode::AmbiguousAdapter,
                format!(
                    "{} .safetensors files and no adapter_config.json; inspect one file, or scan the folder",
                    files.len()
                ),
            )),
        }
    }
}

fn object_stat(o: &object_store::ObjectMeta) -> ObjectStat {
    let t = o.last_modified;
    let ns = t
        .timestamp()
        .checked_mul(1_000_000_000)
        .and_then(|s| s.checked_add(i64::from(t.timestamp_subsec_nanos())));
    ObjectStat {
        size: o.size,
        etag: o.e_tag.clone(),
        // object_store puts the epoch in place of a Last-Modified the server did not send.
        last_modified_ns: ns.filter(|&ns| ns != 0),
    }
}

fn names_file(key: &Key) -> bool {
    key.filename().is_some_and(|n| n.ends_with(".safetensors"))
}

pub(super) fn join(url: &str, name: &str) -> String {
    format!("{}/{name}", url.trim_end_matches('/'))
}

/// A URL that cannot be listed: a `.safetensors` file, else a PEFT folder.
fn guess_target(url: &str, loc: &Loc) -> Target {
    if names_file(&loc.key) || loc.store.listable {
        return Target {
            path: url.into(),
            weights: url.into(),
            config: None,
        };
    }
    Target {
        path: url.into(),
        weights: join(url, PEFT_WEIGHTS).into(),
        config: Some(join(url, CONFIG_NAME).into()),
    }
}

/// A listing as folders, to apply the local discovery rules to.
#[derive(Debug, Default)]
pub(super) struct Dir {
    pub files: BTreeSet<String>,
    pub dirs: BTreeMap<String, Dir>,
}

impl Dir {
    /// Adds one object; hidden entries (and anything under them) are left out, as on disk.
    pub fn insert(&mut self, parts: &[String]) {
        if parts.iter().any(|p| p.starts_with('.') || p.is_empty()) {
            return;
        }
        let Some((file, folders)) = parts.split_last() else {
            return;
        };
        let mut dir = self;
        for f in folders {
            dir = dir.dirs.entry(f.clone()).or_default();
        }
        dir.files.insert(file.clone());
    }

    fn safetensors(&self) -> impl Iterator<Item = &String> {
        self.files.iter().filter(|f| f.ends_with(".safetensors"))
    }

    fn peft(&self, url: &str) -> Result<Target, Error> {
        if self.files.contains(PEFT_WEIGHTS) {
            return Ok(Target {
                path: url.into(),
                weights: join(url, PEFT_WEIGHTS).into(),
                config: Some(join(url, CONFIG_NAME).into()),
            });
        }
        let why = if self.files.contains("adapter_model.bin") {
            REMOTE_PICKLE_WHY
        } else {
            NO_WEIGHTS_WHY
        };
        Err(Error::adapter(url, AdapterErrorCode::MissingWeights, why))
    }

    /// `scan::discover_one` for a folder, on the listing.
    pub fn walk(&self, url: &str, recursive: bool, top: bool, out: &mut Vec<Result<Target, Error>>) {
        if self.files.contains(CONFIG_NAME) {
            out.push(self.peft(url));
            return;
        }
        let files: Vec<&String> = self.safetensors().collect();
        if files.len() == 1 && self.dirs.is_empty() && !top {
            out.push(Ok(Target {
                path: url.into(),
                weights: join(url, files[0]).into(),
                config: None,
            }));
            return;
        }
        for f in files {
            let u = join(url, f);
            out.push(Ok(Target {
                path: u.clone().into(),
                weights: u.into(),
                config: None,
            }));
        }
        if recursive {
            for (name, sub) in &self.dirs {
                sub.walk(&join(url, name), true, false, out);
            }
        }
    }
}
