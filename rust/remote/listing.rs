//! Discovery on a listing: object store prefixes are listed and the local rules apply
//! (`crate::scan`); web servers cannot be listed, so their URLs are taken for a file or a PEFT folder.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::io;
use std::path::PathBuf;
use std::sync::atomic::Ordering;

use futures_util::TryStreamExt;
use object_store::list::PaginatedListOptions;
use object_store::path::Path as Key;
use object_store::ObjectStoreExt;

use super::loading::{NO_WEIGHTS_WHY, REMOTE_PICKLE_WHY};
use super::request::io_err;
use super::stores::{Loc, Remote};
use super::{ObjectStat, Stat, SPECULATIVE_BYTES};
use crate::error::{AdapterErrorCode, Error};
use crate::scan::{Target, CONFIG_NAME, PEFT_WEIGHTS};

/// An adapter's identity for streamed discovery: a load's result depends on nothing else.
pub(super) type TargetKey = (PathBuf, PathBuf, Option<PathBuf>);

pub(super) fn target_key(t: &Target) -> TargetKey {
    (t.path.clone(), t.weights.clone(), t.config.clone())
}

/// Keys in the first page of a streamed listing: enough settled folders to start `concurrency`
/// header reads while the rest of the listing comes, in a short answer.
fn first_page_keys(concurrency: usize) -> usize {
    concurrency.saturating_mul(4).clamp(64, 1000)
}

impl Remote {
    pub(super) async fn discover(&self, url: &str, recursive: bool) -> Vec<Result<Target, Error>> {
        self.discover_streaming(url, recursive, None).await
    }

    /// `discover`; with `emit`, also hands it each target as soon as the listing has settled it
    /// (keys come in order, so a folder the listing has passed gets no more keys), while later
    /// pages are still coming, and then the rest: every target of the result once. A folder is
    /// settled without waiting for its parents', so a target inside a PEFT folder whose
    /// `adapter_config.json` sorts after it can be emitted and then not be in the result (the
    /// local rules leave a PEFT folder's sub-folders out): the caller keeps only the result's.
    pub(super) async fn discover_streaming(
        &self,
        url: &str,
        recursive: bool,
        mut emit: Option<&mut (dyn FnMut(Target) + Send)>,
    ) -> Vec<Result<Target, Error>> {
        if let Some(found) = self.unlisted(url) {
            if let (Some(emit), Ok(t)) = (emit, &found) {
                emit(t.clone());
            }
            return vec![found];
        }
        let loc = match self.loc(url) {
            Ok(l) => l,
            Err(e) => return vec![Err(e)],
        };
        let streaming = emit.is_some() && recursive;
        let mut tree = Dir::default();
        let mut any = false;
        let mut emitted: HashSet<TargetKey> = HashSet::new();
        let mut on_page = |page: Vec<Vec<String>>| {
            any |= !page.is_empty();
            for parts in &page {
                tree.insert(parts);
            }
            if let (true, Some(emit), Some(last)) = (streaming, emit.as_mut(), page.last()) {
                tree.emit_settled(url, last, &mut |t| {
                    if emitted.insert(target_key(&t)) {
                        emit(t);
                    }
                });
            }
        };
        let first_page = streaming.then(|| first_page_keys(self.opts.concurrency));
        if let Err(e) = self.list(&loc, first_page, &mut on_page).await {
            return vec![Err(e)];
        }
        if !any {
            let t = self.lone_object(&loc).await;
            if let (Some(emit), Ok(t)) = (emit, &t) {
                emit(t.clone());
            }
            return vec![t];
        }
        let mut out = Vec::new();
        tree.walk(url, recursive, true, &mut out);
        if let Some(emit) = emit {
            for t in out.iter().flatten() {
                if emitted.insert(target_key(t)) {
                    emit(t.clone());
                }
            }
        }
        out
    }

    /// What discovery finds at `url` without a request, if it needs none: the URL names a
    /// `.safetensors` object or a web server's file or folder (which cannot be listed), or it is
    /// no valid URL.
    pub(super) fn unlisted(&self, url: &str) -> Option<Result<Target, Error>> {
        match self.loc(url) {
            Err(e) => Some(Err(e)),
            Ok(loc) if names_file(&loc.key) || !loc.store.listable => Some(Ok(guess_target(url, &loc))),
            Ok(_) => None,
        }
    }

    /// Every object under a prefix, as key parts relative to it, handed to `on_page` a page at a
    /// time (the first of at most `first_page` keys, when given).
    async fn list(
        &self,
        loc: &Loc,
        first_page: Option<usize>,
        on_page: &mut (dyn FnMut(Vec<Vec<String>>) + Send),
    ) -> Result<(), Error> {
        // One permit for the whole listing: its pages do not queue behind the header reads.
        let _permit = self.permit(loc).await?;
        self.check_stalled(loc)?;
        let prefix = (!loc.key.as_ref().is_empty()).then_some(&loc.key);
        let Some(pages) = &loc.store.pages else {
            let objects: Vec<object_store::ObjectMeta> = loc
                .store
                .inner
                .list(prefix)
                .try_collect()
                .await
                .map_err(|e| self.fail(loc, &e, false))?;
            loc.store.stalls.store(0, Ordering::Relaxed);
            on_page(self.record_listed(loc, objects));
            return Ok(());
        };
        // `list_paginated` takes the prefix as text, with no '/' added.
        let prefix = prefix.map(|k| format!("{}/", k.as_ref()));
        let mut max_keys = first_page;
        let mut token: Option<String> = None;
        loop {
            let options = PaginatedListOptions {
                page_token: token.clone(),
                max_keys: max_keys.take(),
                ..PaginatedListOptions::default()
            };
            let page = pages
                .list_paginated(prefix.as_deref(), options)
                .await
                .map_err(|e| self.fail(loc, &e, false))?;
            loc.store.stalls.store(0, Ordering::Relaxed);
            on_page(self.record_listed(loc, page.result.objects));
            // A server that hands back the token it was given would loop forever.
            match page.page_token {
                Some(next) if !next.is_empty() && token.as_ref() != Some(&next) => token = Some(next),
                _ => return Ok(()),
            }
        }
    }

    /// Listed objects as key parts relative to the listed prefix; what the listing says of each
    /// is kept for `stat` (when asked for) and the small weights' sizes for the first header read.
    fn record_listed(&self, loc: &Loc, objects: Vec<object_store::ObjectMeta>) -> Vec<Vec<String>> {
        let depth = loc.key.parts().count();
        let keep = self.keep_listed.load(Ordering::Relaxed);
        let mut listed = Vec::with_capacity(objects.len());
        let mut stats = Vec::new();
        let mut small = Vec::new();
        for o in objects {
            let parts: Vec<String> = o.location.parts().skip(depth).map(|p| p.as_ref().to_owned()).collect();
            if parts.is_empty() {
                continue;
            }
            let is_small = o.size <= SPECULATIVE_BYTES && names_file(&o.location);
            if keep || is_small {
                // The URL `Dir::walk` gives this object: the prefix's URL and the parts, joined by '/'.
                let url = join(&loc.url, &parts.join("/"));
                if is_small {
                    small.push((url.clone(), o.size));
                }
                if keep {
                    stats.push((url, object_stat(&o)));
                }
            }
            listed.push(parts);
        }
        if !small.is_empty() {
            self.small_objects
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(small);
        }
        if keep {
            self.listed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .extend(stats);
        }
        listed
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
        let _permit = self.permit(loc).await?;
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
            let _permit = self.permit(&loc).await?;
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
    /// Sub-folders whose targets `emit_settled` has not handed out yet.
    pending: Vec<String>,
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
            let Dir { dirs, pending, .. } = dir;
            dir = dirs.entry(f.clone()).or_insert_with(|| {
                pending.push(f.clone());
                Dir::default()
            });
        }
        dir.files.insert(file.clone());
    }

    /// Hands `emit` the targets of the sub-folders (at any depth) the listing has passed: those off
    /// `frontier`, the last listed key's parts below this folder. Each folder once.
    pub fn emit_settled(&mut self, url: &str, frontier: &[String], emit: &mut dyn FnMut(Target)) {
        // The sub-folder the last key lies in, if any: it may still get keys.
        let open = frontier.split_last().and_then(|(_, folders)| folders.first());
        let Dir { dirs, pending, .. } = self;
        pending.retain(|name| {
            let Some(sub) = dirs.get_mut(name) else {
                return false;
            };
            let sub_url = join(url, name);
            if Some(name) == open {
                sub.emit_settled(&sub_url, &frontier[1..], emit);
                return true;
            }
            let mut out = Vec::new();
            sub.walk(&sub_url, true, false, &mut out);
            out.into_iter().flatten().for_each(&mut *emit);
            false
        });
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
