"""Head pruning: costs and budgets, the gates' decisions, head removal, and the smaller
model's export."""
