"""Where a make_*.py script writes a shard: its output directory while that filesystem keeps
the shard plus 2 GB free, else $SPILL_DIR (when set), with a symlink left in the output
directory. For checkpoints larger than the device machine's /dev/shm (half its memory):
the part that does not fit goes to its disk, and the loader's memory map follows the link."""
import os


def shard_path(out_dir, fname, nbytes):
    spill = os.environ.get("SPILL_DIR")
    st = os.statvfs(out_dir)
    if not spill or st.f_bavail * st.f_frsize > nbytes + 2e9:
        return os.path.join(out_dir, fname)
    os.makedirs(spill, exist_ok=True)
    real = os.path.join(spill, os.path.basename(os.path.abspath(out_dir)) + "-" + fname)
    os.symlink(real, os.path.join(out_dir, fname))
    return real
