from unison.cli import entry

entry()
