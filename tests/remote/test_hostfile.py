"""Hostfiles: the three endpoint forms, comments, tags, and a clear error per bad line."""
from __future__ import annotations

import pytest

from batchprompt.remote import HostfileError, parse_hostfile
from batchprompt.remote.hostfile import endpoint_specs


def test_forms_comments_and_tags(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# the cluster\n\nnode-1:8000 weight=2 role=big\nnode-2 8001  # spare\n"
                 "http://10.0.0.7:8002/v1\nhttps://llm.example.org\n[::1]:9000\n")
    specs = parse_hostfile(f)
    assert [s.url for s in specs] == ["http://node-1:8000", "http://node-2:8001", "http://10.0.0.7:8002",
                                      "https://llm.example.org", "http://[::1]:9000"]
    assert specs[0].tags == {"weight": "2", "role": "big"} and specs[0].weight == 2.0
    assert specs[1].weight == 1.0 and specs[3].port == 443


@pytest.mark.parametrize("line, message", [
    ("node-1", r"hosts:1: 'node-1' has no port; give host:port"),
    ("node-1:80x", r"hosts:1: bad port in 'node-1:80x'"),
    ("node-1:8000 weight=0", r"hosts:1: weight must be a number > 0, got '0'"),
    ("node-1:8000 weight=2 extra", r"hosts:1: 'extra' after the tags"),
    ("ftp://node-1:21", r"hosts:1: 'ftp://node-1:21' is not an http\(s\) endpoint"),
    ("# nothing\n", r"lists no endpoint"),
])
def test_bad_lines_name_the_line_and_the_fix(tmp_path, line, message):
    f = tmp_path / "hosts"
    f.write_text(line + "\n")
    with pytest.raises(HostfileError, match=message):
        parse_hostfile(f)


def test_lists_and_duplicates():
    assert [s.url for s in endpoint_specs(["127.0.0.1:8000", "127.0.0.1 8001 weight=3"])] == [
        "http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    with pytest.raises(HostfileError, match="listed twice"):
        endpoint_specs(["127.0.0.1:8000", "http://127.0.0.1:8000/v1"])
    with pytest.raises(HostfileError, match="cannot read the hostfile"):
        endpoint_specs("/nonexistent/hosts")


def test_a_url_or_urls_given_for_the_hostfile_are_the_endpoints():
    """`--endpoints http://127.0.0.1:8000/v1`, as a vLLM user writes a server, was read as a
    file name ("cannot read the hostfile http:/127.0.0.1:8000/v1")."""
    assert [s.url for s in endpoint_specs("http://127.0.0.1:8000/v1")] == ["http://127.0.0.1:8000"]
    assert [s.url for s in endpoint_specs("http://127.0.0.1:8000/v1, https://llm.example.org")] == [
        "http://127.0.0.1:8000", "https://llm.example.org"]
    with pytest.raises(HostfileError, match="not an http"):
        endpoint_specs("ftp://127.0.0.1:8000")


def test_host_ports_given_for_the_hostfile_are_the_endpoints(tmp_path, monkeypatch):
    """The hostfile's own form, `127.0.0.1:8000` (or several, comma-joined), was read as a file
    name ("cannot read the hostfile 127.0.0.1:8000"); a file of that name is still a hostfile."""
    assert [s.url for s in endpoint_specs("127.0.0.1:8000")] == ["http://127.0.0.1:8000"]
    assert [s.url for s in endpoint_specs("gpu1:8000, [::1]:8001")] == ["http://gpu1:8000", "http://[::1]:8001"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts:1").write_text("10.0.0.1:9000\n")
    assert [s.url for s in endpoint_specs("hosts:1")] == ["http://10.0.0.1:9000"]
    with pytest.raises(HostfileError, match="cannot read the hostfile hosts.txt"):
        endpoint_specs("hosts.txt")


def test_a_hostfile_typo_a_repeated_server_and_odd_strings_are_named(tmp_path, monkeypatch):
    """A misspelt weight was kept as a tag of its own and ignored; a server listed twice in a
    hostfile (in two spellings) got twice its share; "" read the hostfile "." ("Is a
    directory"), and host:port/v1 was looked for as a file."""
    f = tmp_path / "hosts"
    f.write_text("node-1:8000 wieght=2\n")
    with pytest.raises(HostfileError, match=r"hosts:1: unknown tag 'wieght': did you mean weight=2\?"):
        parse_hostfile(f)
    f.write_text("node-1:8000 role=big\nhttp://node-1:8000/v1\n")
    with pytest.raises(HostfileError, match="http://node-1:8000 is listed twice"):
        endpoint_specs(str(f))
    with pytest.raises(HostfileError, match="no endpoints given"):
        endpoint_specs("  ")
    monkeypatch.chdir(tmp_path)
    assert [s.url for s in endpoint_specs("127.0.0.1:19250/v1,node-2:8000")] == ["http://127.0.0.1:19250",
                                                                                 "http://node-2:8000"]


def test_a_routes_url_is_its_servers_and_a_bare_host_is_told_to_give_a_port(tmp_path, monkeypatch):
    # The route's URL was taken as a base (GET .../v1/chat/completions/v1/models, a 404); a host
    # without a port was "cannot read the hostfile 127.0.0.1", alone.
    assert [s.url for s in endpoint_specs("http://h:8000/v1/chat/completions,https://g/v1/completions")] == [
        "http://h:8000", "https://g"]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(HostfileError, match=r"if '127.0.0.1' is a server, give its port: 127.0.0.1:8000"):
        endpoint_specs("127.0.0.1")
    # servers joined by spaces were "No such file or directory", alone
    with pytest.raises(HostfileError, match=r"several servers are joined by commas: 127.0.0.1:1,127.0.0.1:2\)"):
        endpoint_specs("127.0.0.1:1 127.0.0.1:2")
