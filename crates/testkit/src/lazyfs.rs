//! A file system that forgets what was not fsynced, for power-loss tests (RELIABILITY.md T5):
//! what LazyFS does for Jepsen (`lose-unfsynced-writes!`), in-process, with FUSE.
//!
//! [`LazyFs::mount`] serves a directory tree at a mount point, backed by a directory on the
//! real disk. A write reaches the daemon, which keeps it in memory, page by page; reads see
//! it; only an `fsync` (or `fdatasync`) of that file writes its pages to the backing file and
//! syncs it. [`LazyFs::power_cut`] unmounts (the kernel's cache of the files goes with the
//! mount) and drops every page not synced: the backing directory is then what a disk would
//! hold after the power went out. [`LazyFs::mount_again`] serves it again. Files and
//! directories keep the owner and mode of their backing ones, and the mount lets other users
//! in (`allow_other`, with the kernel checking permissions), so a server that refuses to run
//! as root (PostgreSQL) can keep its data there.
//!
//! Deliberate simplifications: creating, removing and renaming files and directories, a
//! file's owner and mode, and its size after a truncate once synced, are durable at once (a
//! file system with a journal for its metadata); a sync writes whole pages, never tears one;
//! no hard or symbolic links. [`Fsync::Ignored`] makes every fsync succeed without writing
//! anything: a disk or a configuration that acknowledges what it did not keep, the control a
//! power-loss test needs to show that it can see a loss at all.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyCreate, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyWrite, Request, WriteFlags,
};

/// The unit the daemon keeps unsynced writes in.
const PAGE: u64 = 4096;
/// The kernel asks again for every name and size: what the daemon says is always current.
const TTL: Duration = Duration::ZERO;
const ROOT: u64 = 1;

/// What an `fsync` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fsync {
    /// Writes the file's pages to the backing file and syncs it.
    Honoured,
    /// Succeeds and writes nothing: everything is lost at the next power cut.
    Ignored,
}

/// What a power cut dropped.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Lost {
    /// Files with unsynced writes.
    pub files: usize,
    /// Pages never synced.
    pub pages: usize,
    /// The pages by file name.
    pub by_file: BTreeMap<String, usize>,
}

/// Whether this machine can mount one: `/dev/fuse` is there and the tests run as root. A test
/// that needs it prints why it skips otherwise.
pub fn available() -> Result<(), String> {
    if !Path::new("/dev/fuse").exists() {
        return Err("no /dev/fuse".to_owned());
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let root = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))
        .and_then(|ids| ids.split_whitespace().nth(1))
        == Some("0");
    if !root {
        return Err("not root: mounting without fusermount needs root".to_owned());
    }
    Ok(())
}

/// A mounted lazy file system; unmounted when dropped.
pub struct LazyFs {
    mountpoint: PathBuf,
    state: Arc<Mutex<State>>,
    session: Option<BackgroundSession>,
}

impl LazyFs {
    /// Serves `backing` (an existing directory) at `mountpoint` (an existing, empty one).
    pub fn mount(backing: &Path, mountpoint: &Path, fsync: Fsync) -> io::Result<LazyFs> {
        let state = Arc::new(Mutex::new(State::new(backing, fsync)));
        let mut fs = LazyFs {
            mountpoint: mountpoint.to_owned(),
            state,
            session: None,
        };
        fs.mount_again()?;
        Ok(fs)
    }

    /// Where the files are served.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// Changes what an `fsync` does from now on (a server set up with fsyncs honoured, then
    /// run with them ignored).
    pub fn set_fsync(&self, fsync: Fsync) {
        lock(&self.state).fsync = fsync;
    }

    /// Writes every file's unsynced pages to the disk, as the kernel's periodic write-back does
    /// within about 30 s of a write: what a server wrote at start-up, long before a cut, is on
    /// the disk even if it never fsynced it (RabbitMQ writes its feature-flags file so, and does
    /// not start again without it).
    pub fn write_back(&self) -> io::Result<()> {
        let mut state = lock(&self.state);
        for file in state.files.values_mut() {
            file.sync()?;
        }
        Ok(())
    }

    /// How many fsyncs the file system was asked for.
    pub fn fsyncs(&self) -> u64 {
        lock(&self.state).fsyncs
    }

    /// Cuts the power: from this moment the mount answers every request with an I/O error (a
    /// process still writing writes nothing more), it is detached, and every write not synced
    /// is dropped. Kill the processes using the files first (`kill -9`).
    pub fn power_cut(&mut self) -> Lost {
        self.unmount();
        let mut state = lock(&self.state);
        let state = &mut *state;
        let mut lost = Lost::default();
        for (ino, file) in &mut state.files {
            let pages = file.forget();
            if pages > 0 {
                lost.files += 1;
                lost.pages += pages;
                let name = state
                    .paths
                    .get(ino)
                    .map(|p| p.to_string_lossy().into_owned());
                *lost.by_file.entry(name.unwrap_or_default()).or_default() += pages;
            }
        }
        lost
    }

    /// Serves the backing directory again after [`LazyFs::power_cut`].
    pub fn mount_again(&mut self) -> io::Result<()> {
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName("hooklatch-lazyfs".to_owned()),
            MountOption::DefaultPermissions,
        ];
        config.acl = fuser::SessionACL::All;
        let daemon = Daemon {
            state: self.state.clone(),
            generation: lock(&self.state).generation,
        };
        self.session = Some(fuser::spawn_mount2(daemon, &self.mountpoint, &config)?);
        Ok(())
    }
}

impl LazyFs {
    /// Ends the current mount: its daemon stops serving (the generation moves on), the mount
    /// is detached (lazily: `umount` would fail while a dying process still holds a file), and
    /// the session is let go.
    fn unmount(&mut self) {
        lock(&self.state).generation += 1;
        if let Some(session) = self.session.take() {
            let _ = nix::mount::umount2(&self.mountpoint, nix::mount::MntFlags::MNT_DETACH);
            drop(session);
        }
    }
}

impl Drop for LazyFs {
    fn drop(&mut self) {
        self.unmount();
    }
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

struct State {
    backing: PathBuf,
    fsync: Fsync,
    /// Each inode's path under the backing directory (the root's is empty).
    paths: HashMap<u64, PathBuf>,
    inodes: HashMap<PathBuf, u64>,
    next_inode: u64,
    /// The files opened since the file system was made, by inode.
    files: HashMap<u64, LazyFile>,
    fsyncs: u64,
    /// Which mount serves: a daemon of an earlier one (cut off) answers `EIO`.
    generation: u64,
}

impl State {
    fn new(backing: &Path, fsync: Fsync) -> State {
        let mut state = State {
            backing: backing.to_owned(),
            fsync,
            paths: HashMap::new(),
            inodes: HashMap::new(),
            next_inode: ROOT + 1,
            files: HashMap::new(),
            fsyncs: 0,
            generation: 0,
        };
        state.paths.insert(ROOT, PathBuf::new());
        state.inodes.insert(PathBuf::new(), ROOT);
        state
    }

    /// The inode for `path`, made on first sight.
    fn inode(&mut self, path: &Path) -> u64 {
        if let Some(ino) = self.inodes.get(path) {
            return *ino;
        }
        let ino = self.next_inode;
        self.next_inode += 1;
        self.paths.insert(ino, path.to_owned());
        self.inodes.insert(path.to_owned(), ino);
        ino
    }

    /// The path of `name` in directory `parent`.
    fn child(&self, parent: INodeNo, name: &OsStr) -> Result<PathBuf, Errno> {
        let dir = self.paths.get(&parent.0).ok_or(Errno::ENOENT)?;
        Ok(dir.join(name))
    }

    fn backing_path(&self, ino: u64) -> Result<PathBuf, Errno> {
        let path = self.paths.get(&ino).ok_or(Errno::ENOENT)?;
        Ok(self.backing.join(path))
    }

    /// Forgets `path` and everything under it (removed, or replaced by a rename).
    fn forget_path(&mut self, path: &Path) {
        let gone: Vec<u64> = self
            .inodes
            .iter()
            .filter(|(p, _)| p.starts_with(path))
            .map(|(_, ino)| *ino)
            .collect();
        for ino in gone {
            if let Some(p) = self.paths.remove(&ino) {
                self.inodes.remove(&p);
            }
            self.files.remove(&ino);
        }
    }

    /// Moves `from` and everything under it to `to`, inodes and unsynced pages with them.
    fn move_path(&mut self, from: &Path, to: &Path) {
        let moved: Vec<(PathBuf, u64)> = self
            .inodes
            .iter()
            .filter(|(p, _)| p.starts_with(from))
            .map(|(p, ino)| (p.clone(), *ino))
            .collect();
        for (old, ino) in moved {
            let rest = old.strip_prefix(from).expect("under from");
            let new = if rest.as_os_str().is_empty() {
                to.to_owned()
            } else {
                to.join(rest)
            };
            self.inodes.remove(&old);
            self.inodes.insert(new.clone(), ino);
            self.paths.insert(ino, new);
        }
    }

    /// The file behind `ino`, its backing file opened on first use.
    fn file(&mut self, ino: u64) -> Result<&mut LazyFile, Errno> {
        if !self.files.contains_key(&ino) {
            let path = self.backing_path(ino)?;
            let backing = File::options()
                .read(true)
                .write(true)
                .open(path)
                .map_err(|e| errno(&e))?;
            let size = backing.metadata().map_err(|e| errno(&e))?.len();
            self.files.insert(
                ino,
                LazyFile {
                    backing,
                    size,
                    dirty: BTreeMap::new(),
                    zero_from: None,
                },
            );
        }
        Ok(self.files.get_mut(&ino).expect("just inserted"))
    }

    /// `ino`'s attributes: its backing file's, with the size readers see.
    fn attr(&self, ino: u64) -> Result<FileAttr, Errno> {
        let meta = std::fs::symlink_metadata(self.backing_path(ino)?).map_err(|e| errno(&e))?;
        let size = self.files.get(&ino).map_or(meta.len(), |f| f.size);
        Ok(attr(ino, size, &meta))
    }

    fn entry(&mut self, path: &Path, reply: ReplyEntry) {
        let ino = self.inode(path);
        match self.attr(ino) {
            Ok(attr) => reply.entry(&TTL, &attr, Generation(0)),
            Err(e) => reply.error(e),
        }
    }
}

/// A file's writes since its last sync, over its backing file.
struct LazyFile {
    backing: File,
    /// The size readers see.
    size: u64,
    /// Pages written since the last sync, whole.
    dirty: BTreeMap<u64, Vec<u8>>,
    /// Truncated to this since the last sync: the backing file's bytes from here on read as
    /// zeros.
    zero_from: Option<u64>,
}

impl LazyFile {
    /// Page `index` as readers see it.
    fn page(&self, index: u64) -> io::Result<Vec<u8>> {
        if let Some(page) = self.dirty.get(&index) {
            return Ok(page.clone());
        }
        let mut page = vec![0u8; PAGE as usize];
        let start = index * PAGE;
        let on_disk = self.backing.metadata()?.len();
        let end = (start + PAGE)
            .min(on_disk)
            .min(self.zero_from.unwrap_or(u64::MAX))
            .min(self.size);
        if end > start {
            self.backing
                .read_exact_at(&mut page[..(end - start) as usize], start)?;
        }
        Ok(page)
    }

    fn read(&self, offset: u64, len: u64) -> io::Result<Vec<u8>> {
        let end = (offset + len).min(self.size);
        let mut out = Vec::with_capacity(end.saturating_sub(offset) as usize);
        let mut at = offset;
        while at < end {
            let page = self.page(at / PAGE)?;
            let from = (at % PAGE) as usize;
            let to = ((end - at) as usize + from).min(PAGE as usize);
            out.extend_from_slice(&page[from..to]);
            at += (to - from) as u64;
        }
        Ok(out)
    }

    fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        let mut done = 0usize;
        while done < data.len() {
            let at = offset + done as u64;
            let index = at / PAGE;
            let mut page = self.page(index)?;
            let from = (at % PAGE) as usize;
            let n = (PAGE as usize - from).min(data.len() - done);
            page[from..from + n].copy_from_slice(&data[done..done + n]);
            self.dirty.insert(index, page);
            done += n;
        }
        self.size = self.size.max(offset + data.len() as u64);
        Ok(())
    }

    fn truncate(&mut self, size: u64) -> io::Result<()> {
        if size < self.size {
            // The last page keeps its head; what follows reads as zeros if the file grows.
            if !size.is_multiple_of(PAGE) {
                let index = size / PAGE;
                let mut page = self.page(index)?;
                page[(size % PAGE) as usize..].fill(0);
                self.dirty.insert(index, page);
            }
            self.dirty.retain(|index, _| index * PAGE < size);
            self.zero_from = Some(self.zero_from.map_or(size, |z| z.min(size)));
        }
        self.size = size;
        Ok(())
    }

    /// Writes every dirty page and the size to the backing file, and syncs it.
    fn sync(&mut self) -> io::Result<()> {
        if let Some(zero_from) = self.zero_from.take() {
            self.backing.set_len(zero_from)?;
        }
        for (index, page) in &self.dirty {
            let start = index * PAGE;
            let len = (self.size.saturating_sub(start)).min(PAGE) as usize;
            self.backing.write_all_at(&page[..len], start)?;
        }
        self.backing.set_len(self.size)?;
        self.backing.sync_all()?;
        self.dirty.clear();
        Ok(())
    }

    /// Drops what was not synced; returns how many pages that was.
    fn forget(&mut self) -> usize {
        let pages = self.dirty.len();
        self.dirty.clear();
        self.zero_from = None;
        self.size = self.backing.metadata().map_or(0, |m| m.len());
        pages
    }
}

fn attr(ino: u64, size: u64, meta: &std::fs::Metadata) -> FileAttr {
    use std::os::unix::fs::MetadataExt;
    let kind = if meta.is_dir() {
        FileType::Directory
    } else {
        FileType::RegularFile
    };
    let time = |secs: i64| {
        SystemTime::UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).unwrap_or_default())
    };
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: size.div_ceil(512),
        atime: time(meta.atime()),
        mtime: time(meta.mtime()),
        ctime: time(meta.ctime()),
        crtime: time(meta.ctime()),
        kind,
        perm: (meta.mode() & 0o7777) as u16,
        nlink: meta.nlink() as u32,
        uid: meta.uid(),
        gid: meta.gid(),
        rdev: 0,
        blksize: PAGE as u32,
        flags: 0,
    }
}

fn errno(err: &io::Error) -> Errno {
    Errno::from_i32(err.raw_os_error().unwrap_or(0))
}

/// Gives what a request made to the user who asked, with `mode` less `umask`.
fn own(path: &Path, req: &Request, mode: u32, umask: u32) -> io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(
        path,
        std::fs::Permissions::from_mode(mode & !umask & 0o7777),
    )?;
    std::os::unix::fs::chown(path, Some(req.uid()), Some(req.gid()))
}

/// The FUSE side: every request under one lock.
struct Daemon {
    state: Arc<Mutex<State>>,
    /// The mount this daemon serves.
    generation: u64,
}

/// The state, or the reply's `EIO` when the power of this daemon's mount was cut.
macro_rules! live {
    ($daemon:expr, $reply:expr) => {
        match $daemon.state() {
            Some(state) => state,
            None => return $reply.error(Errno::EIO),
        }
    };
}

impl Daemon {
    fn state(&self) -> Option<MutexGuard<'_, State>> {
        let state = lock(&self.state);
        (state.generation == self.generation).then_some(state)
    }

    /// `unlink` and `rmdir`: `remove` on the backing path, then the inodes under it forgotten.
    fn remove(
        &self,
        parent: INodeNo,
        name: &OsStr,
        remove: fn(&Path) -> io::Result<()>,
        reply: ReplyEmpty,
    ) {
        let mut state = live!(self, reply);
        let removed = state.child(parent, name).and_then(|path| {
            remove(&state.backing.join(&path)).map_err(|e| errno(&e))?;
            Ok(path)
        });
        match removed {
            Ok(path) => {
                state.forget_path(&path);
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }
}

impl Filesystem for Daemon {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let mut state = live!(self, reply);
        let path = match state.child(parent, name) {
            Ok(path) => path,
            Err(e) => return reply.error(e),
        };
        if std::fs::symlink_metadata(state.backing.join(&path)).is_err() {
            return reply.error(Errno::ENOENT);
        }
        state.entry(&path, reply);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match live!(self, reply).attr(ino.0) {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        _atime: Option<fuser::TimeOrNow>,
        _mtime: Option<fuser::TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        use std::os::unix::fs::PermissionsExt;
        let mut state = live!(self, reply);
        let changed = (|| {
            let path = state.backing_path(ino.0)?;
            if let Some(mode) = mode {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & 0o7777))
                    .map_err(|e| errno(&e))?;
            }
            if uid.is_some() || gid.is_some() {
                std::os::unix::fs::chown(&path, uid, gid).map_err(|e| errno(&e))?;
            }
            if let Some(size) = size {
                state.file(ino.0)?.truncate(size).map_err(|e| errno(&e))?;
            }
            state.attr(ino.0)
        })();
        match changed {
            Ok(attr) => reply.attr(&TTL, &attr),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        let mut state = live!(self, reply);
        let made = state.child(parent, name).and_then(|path| {
            let real = state.backing.join(&path);
            std::fs::create_dir(&real)
                .and_then(|()| own(&real, req, mode, umask))
                .map_err(|e| errno(&e))?;
            Ok(path)
        });
        match made {
            Ok(path) => state.entry(&path, reply),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, |p| std::fs::remove_file(p), reply);
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        self.remove(parent, name, |p| std::fs::remove_dir(p), reply);
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        _flags: fuser::RenameFlags,
        reply: ReplyEmpty,
    ) {
        let mut state = live!(self, reply);
        let renamed = state.child(parent, name).and_then(|from| {
            let to = state.child(newparent, newname)?;
            std::fs::rename(state.backing.join(&from), state.backing.join(&to))
                .map_err(|e| errno(&e))?;
            Ok((from, to))
        });
        match renamed {
            Ok((from, to)) => {
                state.forget_path(&to);
                state.move_path(&from, &to);
                reply.ok();
            }
            Err(e) => reply.error(e),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match live!(self, reply).file(ino.0) {
            Ok(_) => reply.opened(FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let mut state = live!(self, reply);
        let data = state
            .file(ino.0)
            .and_then(|f| f.read(offset, u64::from(size)).map_err(|e| errno(&e)));
        match data {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(e),
        }
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut state = live!(self, reply);
        let written = state
            .file(ino.0)
            .and_then(|f| f.write(offset, data).map_err(|e| errno(&e)));
        match written {
            Ok(()) => reply.written(data.len() as u32),
            Err(e) => reply.error(e),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        let mut state = live!(self, reply);
        state.fsyncs += 1;
        if state.fsync == Fsync::Ignored {
            return reply.ok();
        }
        match state
            .file(ino.0)
            .and_then(|f| f.sync().map_err(|e| errno(&e)))
        {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    /// The backing file system's figures: a server that checks its free space (RabbitMQ's
    /// disk alarm blocks publishers below 50 MB) sees the real disk's.
    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: fuser::ReplyStatfs) {
        let state = live!(self, reply);
        match nix::sys::statvfs::statvfs(&state.backing) {
            Ok(vfs) => reply.statfs(
                vfs.blocks(),
                vfs.blocks_free(),
                vfs.blocks_available(),
                vfs.files(),
                vfs.files_free(),
                vfs.block_size() as u32,
                vfs.name_max() as u32,
                vfs.fragment_size() as u32,
            ),
            Err(e) => reply.error(Errno::from_i32(e as i32)),
        }
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let mut state = live!(self, reply);
        let listed = state.backing_path(ino.0).and_then(|dir| {
            let entries = std::fs::read_dir(dir).map_err(|e| errno(&e))?;
            Ok(entries
                .filter_map(Result::ok)
                .map(|e| {
                    let dir = e.file_type().is_ok_and(|t| t.is_dir());
                    (e.file_name(), dir)
                })
                .collect::<Vec<_>>())
        });
        let names = match listed {
            Ok(names) => names,
            Err(e) => return reply.error(e),
        };
        let parent = state.paths.get(&ino.0).cloned().unwrap_or_default();
        let mut entries = vec![
            (ino.0, FileType::Directory, OsString::from(".")),
            (ino.0, FileType::Directory, OsString::from("..")),
        ];
        for (name, dir) in names {
            let child = state.inode(&parent.join(&name));
            let kind = if dir {
                FileType::Directory
            } else {
                FileType::RegularFile
            };
            entries.push((child, kind, name));
        }
        for (i, (ino, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(ino), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        flags: i32,
        reply: ReplyCreate,
    ) {
        const O_EXCL: i32 = 0o200;
        let mut state = live!(self, reply);
        let created = state.child(parent, name).and_then(|path| {
            let real = state.backing.join(&path);
            let mut open = File::options();
            open.write(true);
            if flags & O_EXCL != 0 {
                open.create_new(true);
            } else {
                open.create(true);
            }
            open.open(&real)
                .and_then(|_| own(&real, req, mode, umask))
                .map_err(|e| errno(&e))?;
            let ino = state.inode(&path);
            state.file(ino)?;
            state.attr(ino)
        });
        match created {
            Ok(attr) => reply.created(
                &TTL,
                &attr,
                Generation(0),
                FileHandle(0),
                FopenFlags::empty(),
            ),
            Err(e) => reply.error(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &Path, name: &str) -> LazyFile {
        let path = dir.join(name);
        let backing = File::options()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        LazyFile {
            backing,
            size: 0,
            dirty: BTreeMap::new(),
            zero_from: None,
        }
    }

    #[test]
    fn unsynced_writes_are_read_back_then_lost_synced_ones_are_kept() {
        let dir = std::env::temp_dir().join(format!("lazyfs-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut f = file(&dir, "a");
        f.write(0, &[1u8; 5000]).unwrap();
        f.write(4090, b"across a page").unwrap();
        assert_eq!(f.size, 5000);
        assert_eq!(&f.read(4090, 13).unwrap(), b"across a page");
        assert_eq!(
            std::fs::metadata(dir.join("a")).unwrap().len(),
            0,
            "nothing on disk"
        );
        f.sync().unwrap();
        assert_eq!(
            std::fs::read(dir.join("a")).unwrap()[4090..4103],
            *b"across a page"
        );

        f.write(0, b"later").unwrap();
        f.truncate(100).unwrap();
        f.truncate(9000).unwrap();
        assert_eq!(f.read(0, 5).unwrap(), b"later");
        assert_eq!(
            f.read(4090, 13).unwrap(),
            vec![0; 13],
            "zeros after the truncate"
        );
        assert_eq!(f.forget(), 1);
        assert_eq!(f.size, 5000);
        assert_eq!(f.read(0, 3).unwrap(), vec![1; 3], "the synced bytes");
        assert_eq!(&f.read(4090, 13).unwrap(), b"across a page");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
