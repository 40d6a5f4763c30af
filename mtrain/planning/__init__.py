"""--mode=plan: what a compiled step needs and how long it takes, before renting a pod."""
