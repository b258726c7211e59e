"""E2B's envd file behaviours (envd 0.6.4) through the official Python SDK, on clade's `base` (templates/e2b-base):
files and directories made by the SDK belong to the user they were made as, upload metadata lives in `user.e2b.*`
extended attributes (also ones set inside the sandbox), a symlink reports its target, signed file URLs work and
a wrong or expired one is refused, and watch events carry the entry. Env as sdk_flow.py."""

import json
import os
import sys
import time
import urllib.error
import urllib.request

from e2b import Sandbox
from e2b.sandbox.filesystem.filesystem import FileType

TEMPLATE = os.environ.get("E2B_TEMPLATE", "base")


def check(name, cond, detail=""):
    print(("ok   " if cond else "FAIL ") + name + (f"  [{detail}]" if detail else ""), flush=True)
    if not cond:
        sys.exit(1)


def status_of(url):
    try:
        with urllib.request.urlopen(url) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


sbx = Sandbox.create(TEMPLATE)

# Ownership: as envd, which writes as the user.
info = sbx.files.write("owned/deep/a.txt", "x")
st = sbx.files.get_info(info.path)
check("an upload belongs to the user", (st.owner, st.group) == ("user", "user"), f"{st.owner}:{st.group}")
made = sbx.files.get_info("owned/deep")
check("parents made for an upload belong to the user", made.owner == "user", made.owner)
sbx.files.make_dir("mine/sub")
check("make_dir as the user", sbx.files.get_info("mine/sub").owner == "user")
as_root = sbx.files.write("/tmp/root.txt", "r", user="root")
check("an upload as root belongs to root", sbx.files.get_info(as_root.path, user="root").owner == "root")
r = sbx.commands.run("echo more >> owned/deep/a.txt && echo ok")
check("the user can append to its upload", r.stdout.strip() == "ok", r.stderr)

# Metadata: X-Metadata-* -> user.e2b.* xattrs, surfaced by stat and list, gone on overwrite.
meta = {"author": "mish", "purpose": "upload"}
w = sbx.files.write("m.txt", "content", metadata=meta)
check("write answers the metadata", w.metadata == meta, repr(w.metadata))
check("stat surfaces the metadata", sbx.files.get_info("m.txt").metadata == meta)
listed = [e for e in sbx.files.list(".") if e.name == "m.txt"]
check("list surfaces the metadata", listed and listed[0].metadata == meta)
raw = sbx.commands.run("python3 -c \"import os; print(os.getxattr('m.txt', 'user.e2b.author').decode())\"")
check("kept as a user.e2b.* xattr in the sandbox", raw.stdout.strip() == "mish", raw.stdout + raw.stderr)
sbx.files.rename("m.txt", "m2.txt")
check("metadata follows a rename", sbx.files.get_info("m2.txt").metadata == meta)
sbx.files.write("m2.txt", "new")
check("an overwrite without metadata clears it", sbx.files.get_info("m2.txt").metadata is None)
sbx.commands.run("python3 -c \"import os; os.setxattr('m2.txt', 'user.e2b.k', b'set inside')\"")
check("an xattr set inside is metadata", sbx.files.get_info("m2.txt").metadata == {"k": "set inside"})

# Symlinks: the target's type, and the absolute path it resolves to.
sbx.commands.run("mkdir -p ln && echo hi > ln/t.txt && ln -s t.txt ln/l.txt")
l = sbx.files.get_info("ln/l.txt")
check("a symlink reports its target's type", l.type == FileType.FILE, repr(l.type))
check("and the absolute target", l.symlink_target == "/home/user/ln/t.txt", repr(l.symlink_target))

# Signed URLs: any client can use one; a tampered or expired one is refused with envd's answer.
sbx.files.write("signed.txt", "signed content")
code, body = status_of(sbx.download_url("signed.txt", "user"))
check("a signed download URL", (code, body) == (200, "signed content"), f"{code} {body[:80]}")
code, body = status_of(sbx.download_url("signed.txt", "user", 60))
check("a signed URL with an expiry", code == 200, f"{code} {body[:80]}")
code, body = status_of(sbx.download_url("signed.txt", "user", use_signature_expiration=-60))
check("an expired signature is 401", code == 401 and json.loads(body)["message"] == "signature is already expired", body)
url = sbx.download_url("signed.txt", "user").replace("signature=v1_", "signature=v1_A")
check("a tampered signature is 401", status_of(url)[0] == 401)
other = sbx.download_url("signed.txt", "root")
code, _ = status_of(other.replace("username=root", "username=user"))
check("a signature binds its user", code == 401, str(code))

# Watch events with the entry (envd 0.6.3).
sbx.files.make_dir("w")
h = sbx.files.watch_dir("w", include_entry=True)
sbx.files.write("w/f.txt", "x")
time.sleep(0.6)
evs = h.get_new_events()
created = [e for e in evs if e.name == "f.txt" and e.entry is not None]
check("a watch event carries the entry", created and created[0].entry.owner == "user", repr(evs))
h.stop()

# Watch events as they happen (inotify in the sandbox, no polling delay): an upload of a new file is a create,
# a write and a chmod (its owner), as envd reports it; a nested directory made after the watch started is
# followed; a command's changes are seen as well as the API's.
sbx.files.make_dir("w2/nested")
h = sbx.files.watch_dir("w2", recursive=True)
sbx.files.write("w2/nested/a.txt", "hello")
evs = h.get_new_events()
kinds = sorted(e.type.name for e in evs)
check("an upload: create, write, chmod at once", [e.name for e in evs][:1] == ["nested/a.txt"]
      and kinds == ["CHMOD", "CREATE", "WRITE"], repr(evs))
sbx.files.write("w2/nested/a.txt", "again")
evs = h.get_new_events()
check("an overwrite: no create", any(e.type.name == "WRITE" for e in evs)
      and not any(e.type.name == "CREATE" for e in evs), repr(evs))
sbx.commands.run("mkdir /home/user/w2/later && echo x > /home/user/w2/later/b && rm /home/user/w2/nested/a.txt")
evs = [(e.name, e.type.name) for e in h.get_new_events()]
check("a command's changes, a new directory followed", ("later", "CREATE") in evs and ("later/b", "CREATE") in evs
      and ("nested/a.txt", "REMOVE") in evs, repr(evs))
h.stop()

sbx.kill()
print("all passed")
