"""sweep=pbt: generations (the rule), population (the node side), replay (reproducing a member)."""
