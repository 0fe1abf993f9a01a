// defines: write_file_atomically(), the one way gradsync writes a file that must never be seen half-written
// (state dicts, sharded checkpoints): after it returns the path holds the new file; if it throws, the path still
// holds the old one and no temp file is left behind.
#pragma once
#include <string>
#include <vector>

namespace gradsync {

// Temp file in the target's directory (so the rename cannot cross file systems), write, fsync, rename over the
// path, fsync the directory (so the rename itself survives a crash; best effort, after the rename). Every failure
// before the rename closes the descriptor and removes the temp file, then throws Error naming the path, the step
// and errno.
//
// The temp file is <path>.tmp.<pid>.<random>, created with O_EXCL | O_NOFOLLOW: a file or symlink planted under
// that name makes the open fail (another name is tried) instead of redirecting the write. Temp files of this path
// that a killed writer left behind (their pid no longer runs) are removed first.
void write_file_atomically(const std::string& path, const std::vector<char>& bytes);

// Opens `path` for writing only if nothing exists under that name, never through a symlink; -1 with errno set
// otherwise (EEXIST for any existing name, dangling symlinks included).
int create_exclusive(const std::string& path);

// Removes <path>.tmp.<pid>.* entries whose pid no longer runs; returns how many.
int remove_stale_temp_files(const std::string& path);
// The same for every file of `directory`: any <name>.tmp.<pid>.<random> whose pid no longer runs.
int remove_stale_temp_files_in(const std::string& directory);

// fsync of a directory (after a rename, mkdir or unlink in it), so the change survives a crash; best effort.
void fsync_directory(const std::string& dir);

// Creates DIR and its missing parents (mkdir -p); throws Error naming the first directory that cannot be made.
void make_directories(const std::string& dir);

}  // namespace gradsync
