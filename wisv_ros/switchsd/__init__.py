"""SwitchSD copy drafting: copy candidates and tree verification, the copy probe at run time, and its training (offline)."""
