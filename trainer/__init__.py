"""DeepSpeed ZeRO trainer for ViT-B/16, L/16, H/14. Built in issue 4; nothing here yet."""
