"""How deep to nest JSON for a test of JSON nested too deeply: past the parser's recursion limit
on each Python we run (3.11 and 3.12.1 refuse 5,000 levels; 3.12.3 parses them; 3.13 parses
5,000 and refuses 20,000), and small enough for a server's 64 KiB body limit."""
DEEP = 30_000
