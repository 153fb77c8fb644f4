//! The lazy file system mounted for real (FUSE): written and read through the kernel, then a
//! power cut keeps what was fsynced and loses the rest; with fsync ignored, it loses all.
#![cfg(feature = "lazyfs")]

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};

use hooklatch_testkit::lazyfs::{available, Fsync, LazyFs};

fn mounted(fsync: Fsync) -> Option<(tempfile::TempDir, LazyFs)> {
    // Not asserted under CI: a machine without FUSE cannot be given it by `.ci/run`. Where it
    // is there, a mount that fails fails the test.
    if let Err(why) = available() {
        println!("skipped: the lazy file system needs /dev/fuse and root ({why})");
        return None;
    }
    let dir = tempfile::tempdir().unwrap();
    let (backing, mnt) = (dir.path().join("backing"), dir.path().join("mnt"));
    std::fs::create_dir_all(&backing).unwrap();
    std::fs::create_dir_all(&mnt).unwrap();
    let fs = LazyFs::mount(&backing, &mnt, fsync).expect("mounting the lazy file system");
    Some((dir, fs))
}

fn read(path: &std::path::Path) -> Vec<u8> {
    let mut out = Vec::new();
    File::open(path).unwrap().read_to_end(&mut out).unwrap();
    out
}

#[test]
fn a_power_cut_keeps_what_was_fsynced_and_loses_the_rest() {
    let Some((dir, mut fs)) = mounted(Fsync::Honoured) else {
        return;
    };
    // The backing disk's free space, not none (a server with a disk alarm would stop).
    let vfs = nix::sys::statvfs::statvfs(fs.path()).expect("statvfs of the mount");
    let backing = nix::sys::statvfs::statvfs(dir.path()).expect("statvfs of the disk");
    assert!(vfs.blocks_available() > 0, "no free space reported");
    assert_eq!(vfs.blocks(), backing.blocks());
    let path = fs.path().join("wal");
    let mut f = File::create(&path).unwrap();
    f.write_all(&[7u8; 10_000]).unwrap();
    f.sync_all().unwrap();
    f.seek(SeekFrom::Start(9_998)).unwrap();
    f.write_all(b"unsynced tail").unwrap();
    assert_eq!(read(&path).len(), 10_011, "reads see the unsynced write");
    assert_eq!(&read(&path)[9_998..], b"unsynced tail");
    let other = fs.path().join("never-synced");
    File::create(&other).unwrap().write_all(b"gone").unwrap();
    drop(f);
    assert!(fs.fsyncs() >= 1);

    let lost = fs.power_cut();
    assert_eq!((lost.files, lost.pages), (2, 2), "{lost:?}");
    fs.mount_again().unwrap();
    assert_eq!(
        read(&path),
        vec![7u8; 10_000],
        "the synced bytes, nothing after"
    );
    assert_eq!(read(&other), b"", "created, but its bytes never synced");
    drop(fs);
    drop(dir);
}

#[test]
fn with_fsync_ignored_a_power_cut_loses_everything_written() {
    let Some((_dir, mut fs)) = mounted(Fsync::Ignored) else {
        return;
    };
    let path = fs.path().join("db");
    let mut f = File::create(&path).unwrap();
    f.write_all(b"acknowledged, never kept").unwrap();
    f.sync_all().unwrap();
    drop(f);
    let lost = fs.power_cut();
    assert_eq!(lost.files, 1);
    fs.mount_again().unwrap();
    assert_eq!(read(&path), b"");
}
