-- Issue 29: a deployment's tasks remember their deployment, so a cancel finds the tasks a step
-- created for the targets it stops (a step that read the deployment before the cancel).
ALTER TABLE tasks ADD COLUMN deployment_id UUID;
CREATE INDEX idx_tasks_deployment ON tasks (deployment_id) WHERE deployment_id IS NOT NULL;
